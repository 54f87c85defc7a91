"""The service event log (issue 14 item 5, its event-log part): `labkit serve` keeps one under runs/ without
--out, capped in size and rotated (PATH.1 newest ... PATH.N oldest), each file starting with the header."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from labkit.paths import runs_dir
from serve.errors import ServeError
from serve.observe.events import EventLog, plan_serve_log


def lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def fill(log: EventLog, n: int) -> None:
    log.write_header({"role": "test"})
    for i in range(n):
        log.write({"event": "token", "seq": i, "pad": "x" * 40})
    log.close()


def test_a_tiny_cap_rotates_and_keeps_the_newest_files(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(path, max_bytes=1000, backups=2)
    fill(log, 200)
    files = [path.with_name("ev.jsonl.2"), path.with_name("ev.jsonl.1"), path]      # oldest first
    assert all(f.is_file() for f in files) and not path.with_name("ev.jsonl.3").exists()
    assert log.rotations > 2                                                         # older parts were dropped
    seqs = []
    for f in files:
        recs = lines(f)
        assert recs[0]["event"] == "header" and recs[0]["role"] == "test"
        longest = max(len(x) + 1 for x in f.read_text().splitlines())
        assert f.stat().st_size < 1000 + longest
        seqs += [r["seq"] for r in recs[1:]]
    assert seqs == list(range(seqs[0], 200)) and seqs[0] > 0                         # contiguous, newest kept
    assert [lines(f)[0].get("rotation") for f in files] == [log.rotations - 2, log.rotations - 1, log.rotations]


def test_no_backups_starts_the_file_over(tmp_path):
    path = tmp_path / "ev.jsonl"
    log = EventLog(path, max_bytes=1000, backups=0)
    fill(log, 200)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ev.jsonl"]
    recs = lines(path)
    assert recs[0]["event"] == "header" and recs[-1]["seq"] == 199 and path.stat().st_size < 1100


def test_without_a_cap_nothing_rotates(tmp_path):
    path = tmp_path / "ev.jsonl"
    fill(EventLog(path), 200)
    assert len(lines(path)) == 201 and sorted(p.name for p in tmp_path.iterdir()) == ["ev.jsonl"]


def test_the_previous_run_moves_to_the_first_backup(tmp_path):
    path = tmp_path / "ev.jsonl"
    fill(EventLog(path), 3)
    fill(EventLog(path, max_bytes=10_000, backups=2, rotate_existing=True), 5)
    assert len(lines(path.with_name("ev.jsonl.1"))) == 4 and len(lines(path)) == 6


def test_the_plan(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))
    plan = plan_serve_log(None, "worker-0", log_dir=runs_dir())       # as labkit serve gives it
    assert plan.path == tmp_path / "runs" / "serve-worker-0.jsonl"
    assert plan.max_bytes == 256_000_000 and plan.backups == 3 and plan.rotate_existing
    assert plan_serve_log(None, "w", enabled=False).path is None
    given = plan_serve_log(tmp_path / "mine.jsonl", "w")
    assert given.max_bytes is None and not given.rotate_existing                   # --out: as before, no cap
    assert plan_serve_log(tmp_path / "mine.jsonl", "w", max_mb=1).max_bytes == 1_000_000
    for bad in ({"max_mb": 0}, {"max_mb": -1}, {"backups": -1}):
        with pytest.raises(ServeError):
            plan_serve_log(None, "w", **bad)


def test_two_servers_with_one_worker_id_never_share_a_log(tmp_path, monkeypatch):
    """Issue 29 item 14: a second start while the first still writes gets a log of its own (pid suffix); the
    first's file is neither moved nor truncated, and rotation moves only each process's own file."""
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))

    def write(log: EventLog, n: int) -> None:
        for i in range(n):
            log.write({"event": "token", "seq": i, "pad": "x" * 40})
        log.flush()

    first = plan_serve_log(None, "worker-0", max_mb=0.002, backups=2, log_dir=runs_dir()).open()
    first.write_header({"role": "first"})
    write(first, 3)
    second = plan_serve_log(None, "worker-0", max_mb=0.002, backups=2, log_dir=runs_dir()).open()
    second.write_header({"role": "second"})
    assert second.path != first.path and str(os.getpid()) in second.path.name
    write(second, 40)                                   # rotates: its own file only
    write(first, 2)
    first.close()
    second.close()
    assert [r.get("role") for r in lines(first.path)] == ["first"] + [None] * 5
    assert not first.backup_path(1).exists() and second.rotations >= 1 and second.backup_path(1).exists()
    third = plan_serve_log(None, "worker-0", log_dir=runs_dir()).open()    # the first has stopped: its name is free again, rotated
    assert third.path == first.path and len(lines(first.backup_path(1))) == 6
    third.close()


def test_serve_help_documents_the_log(cli_app):
    from typer.testing import CliRunner

    text = " ".join(CliRunner().invoke(cli_app, ["serve", "--help"], env={"COLUMNS": "200"}).output.split())
    for option in ("--event-log-max-mb", "--event-log-backups", "--no-event-log", "runs/serve-<worker-id>.jsonl"):
        assert option in text, option


def test_serve_without_out_keeps_a_rotated_log_under_runs(tiny_model_dir, tmp_path):
    runs = tmp_path / "runs"
    env = {**os.environ, "LABKIT_RUNS_DIR": str(runs)}
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "serve", str(tiny_model_dir), "--port", "0",
                             "--device", "cpu", "--max-model-len", "256", "--worker-id", "evlog",
                             "--event-log-max-mb", "0.004", "--event-log-backups", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url, seen = None, []
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen.append(line)
            m = re.search(r"ready: (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert url, "".join(seen)
        import urllib.request

        body = json.dumps({"prompt_token_ids": list(range(100, 120)), "max_tokens": 120, "ignore_eos": True,
                           "stream": False}).encode()
        req = urllib.request.Request(f"{url}/generate", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = runs / "serve-evlog.jsonl"
    names = sorted(p.name for p in runs.iterdir() if p.name.startswith("serve-evlog"))
    assert names == ["serve-evlog.jsonl", "serve-evlog.jsonl.1", "serve-evlog.jsonl.2"], names
    for f in (log, log.with_name("serve-evlog.jsonl.1"), log.with_name("serve-evlog.jsonl.2")):
        recs = lines(f)
        assert recs[0]["event"] == "header" and recs[0]["role"] == "server" and recs[0]["url"] == url
        assert f.stat().st_size < 4000 + 2000
    assert lines(log)[-1]["what"] == "closed"
