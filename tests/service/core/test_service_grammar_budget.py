"""Constrained decoding that one client cannot turn against the others (engine/sampling/structured.py,
serve/core/front.py), through the running server on the tiny model: the compiled-grammar cache bounded by
bytes; a request's compiled grammar pinned while it lives, so the step loop never compiles; compiles with a
time and size budget in their own worker; a per-step budget on each request's mask work; the grammar
compiler's own stderr escaped."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from service_fixtures import Served, post, ready_url, serving, settle_after

pytest.importorskip("xgrammar")

CACHE_MB = 16


def wide_schema(tag: str, n: int = 600) -> dict:
    """A schema of n required string properties: about 5 MB compiled over the Qwen vocabulary."""
    names = [f"{tag}_{i}" for i in range(n)]
    return {"type": "object", "properties": {k: {"type": "string", "maxLength": 8} for k in names},
            "required": names}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    yield from serving(tiny_model_dir, record=False, max_active=2, queue_size=16, max_model_len=256,
                       worker_id="grammar-budget", grammar_cache_mb=CACHE_MB)


_idle = settle_after("server")


def test_grammar_cache_is_bounded_by_bytes(server):
    for i in range(6):
        status, res = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2,
                                                       "structured_outputs": {"json": wide_schema(f"s{i}")}})
        assert status == 200, res
    cache = server.worker.engine.grammars._cache
    held = sum(int(g.memory_size_bytes) for g in cache.values())
    assert 0 < held <= CACHE_MB << 20, (len(cache), held)


def test_a_grammar_evicted_while_queued_is_not_compiled_in_the_step_loop(server, monkeypatch):
    """A request's compiled grammar is pinned while it lives: the cache dropping it while the request waits
    does not make the owner thread (the step loop) compile it again at admission."""
    from engine.sampling import structured

    worker = server.worker
    compiled_on: list[str] = []
    real = structured._compile

    def spy(compiler, so):
        compiled_on.append(threading.current_thread().name)
        return real(compiler, so)

    monkeypatch.setattr(structured, "_compile", spy)
    worker.pause()
    try:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(post, server, "/v1/completions",
                                 {"prompt": "x", "max_tokens": 2, "structured_outputs": {"json": wide_schema("q")}})
            deadline = time.monotonic() + 30
            while not worker.pending_ids() and time.monotonic() < deadline:
                time.sleep(0.01)
            assert worker.pending_ids(), "the request never queued"
            assert len(compiled_on) == 1                     # compiled at submit
            worker.engine.grammars._cache.clear()            # evicted while it waits
            worker.resume()
            status, res = answer.result(60)
    finally:
        worker.resume()
    assert status == 200, res
    assert compiled_on.count(worker._thread.name) == 0, compiled_on


def costly_schema(tag: str, n: int = 400) -> dict:
    """n optional properties: xgrammar's compile time grows with their square (seconds at 400 on a CPU)."""
    return {"type": "object", "properties": {f"{tag}_{i}": {"type": "string", "maxLength": 20} for i in range(n)}}


def timed_post(server, path: str, body: dict) -> tuple[int, dict, float]:
    t0 = time.monotonic()
    status, res = post(server, path, body)
    return status, res, time.monotonic() - t0


def test_compiles_past_their_budget_are_400s_and_never_hold_text_requests(server, monkeypatch):
    """Schemas that take seconds to compile: each is a 400 naming its field once the compile budget passes
    (one asked again is refused at once, without a second compile), and a plain text request sent while eight
    of them arrive together is answered without waiting for a compile (compiles run in their own worker, not
    in the pool that prepares text requests)."""
    monkeypatch.setattr(server.worker.engine.grammars, "compile_timeout_s", 0.5, raising=False)
    hostile = [{"prompt": "x", "max_tokens": 2, "response_format": {
        "type": "json_schema", "json_schema": {"name": "h", "schema": costly_schema(f"h{i}", 800)}}} for i in range(9)]
    for took_at_most in (30.0, 0.4):                        # compiled once past its budget, then refused at once
        st, err, took = timed_post(server, "/v1/completions", hostile[8])
        assert st == 400 and err["error"]["param"] == "response_format", err
        assert "budget" in err["error"]["message"] and took < took_at_most, (err, took)
    with ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(timed_post, server, "/v1/completions", b) for b in hostile[:8]]
        time.sleep(0.3)
        status, res, plain_s = timed_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 8})
        hostile_answers = [a.result(120) for a in answers]
    assert status == 200, res
    for st, err, took in hostile_answers:
        assert st == 400 and err["error"]["param"] == "response_format", err
        assert "budget" in err["error"]["message"], err
    assert plain_s < 2.0, f"a plain 8-token request took {plain_s:.2f} s while grammars compiled"
    # a compile past its budget runs on in the one compile worker (xgrammar cannot stop it): let it end, so the
    # next test's compile does not queue behind it (on a loaded machine that wait alone passed 10 s)
    grammars = server.worker.engine.grammars
    deadline = time.monotonic() + 300
    while grammars._inflight and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not grammars._inflight, "a compile past its budget was still running after 300 s"


AMBIGUOUS = 'root ::= (s)*\ns ::= s s | [a-z] | s'      # its matcher's work grows with every character


def test_a_grammar_whose_mask_work_grows_is_finished_at_its_step_budget(server):
    """An ambiguous EBNF whose mask costs more with every token finishes (finish_reason abort) once one step's
    mask work passes the per-request budget, while a plain request beside it answers at its usual pace."""
    body = {"prompt": "x", "max_tokens": 64, "temperature": 1.0, "seed": 1,
            "structured_outputs": {"grammar": AMBIGUOUS}}
    with ThreadPoolExecutor(1) as pool:
        hostile = pool.submit(timed_post, server, "/v1/completions", body)
        time.sleep(0.5)
        status, res, plain_s = timed_post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 8,
                                                                      "ignore_eos": True})
        st, out, took = hostile.result(300)
    assert status == 200 and st == 200, (res, out)
    assert out["choices"][0]["finish_reason"] == "abort", out
    assert out["usage"]["completion_tokens"] < 64, out
    assert plain_s < 2.0 and took < 10.0, (plain_s, took)


def test_the_grammar_compilers_own_warnings_reach_stderr_escaped(tiny_model_dir, tmp_path):
    """xgrammar's C++ warnings quote the schema (a $ref URI with CR and ESC in it): `labkit serve` writes them
    to its stderr escaped like its own log lines, so no raw control character and no forged line gets there."""
    err_path = tmp_path / "stderr"
    with open(err_path, "wb") as err:
        proc = subprocess.Popen([sys.executable, "-m", "labkit", "serve", str(tiny_model_dir), "--port", "0",
                                 "--device", "cpu", "--max-model-len", "256", "--no-event-log",
                                 "--worker-id", "native-log"],
                                stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        url = ready_url(proc, 120)
        assert url, err_path.read_text(errors="replace")
        evil = {"type": "object", "properties": {"a": {"$ref": "http://x\r\nINFO forged line\x1b[2J"}}}
        status, _ = post(Served(url, None, None, "subprocess", None), "/v1/completions",
                         {"prompt": "x", "max_tokens": 2, "structured_outputs": {"json": evil}})
        assert status in (200, 400)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    raw = err_path.read_bytes()
    assert b"URI should" in raw, raw[-2000:]                         # the warning was written, escaped
    assert b"\r" not in raw and b"\x1b" not in raw, raw[-2000:]
    assert not any(line.startswith(b"INFO forged") for line in raw.split(b"\n")), raw[-2000:]


def test_labkit_serve_exits_promptly_while_a_compile_past_its_budget_runs(tiny_model_dir):
    """A compile past its budget runs on (xgrammar cannot stop it) in a daemon worker: SIGINT still ends
    `labkit serve` at once, not when that compile ends minutes later."""
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "serve", str(tiny_model_dir), "--port", "0",
                             "--device", "cpu", "--max-model-len", "256", "--no-event-log", "--worker-id", "exit",
                             "--grammar-compile-timeout", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = ready_url(proc, 120)
        assert url
        status, err = post(Served(url, None, None, "subprocess", None), "/v1/completions",
                           {"prompt": "x", "max_tokens": 2, "structured_outputs": {"json": costly_schema("x", 3000)}})
        assert status == 400 and "budget" in err["error"]["message"], err
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=45)
        assert time.monotonic() - t0 < 45
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def large_tool_body(i: int, kb: int = 850) -> dict:
    """A chat request with tool_choice required over four tools whose schemas hold about ``kb`` KB in all."""
    n = kb * 1024 // 200
    props = [(f"t{i}_field_{j}", {"type": "string", "description": "d" * 150}) for j in range(n)]
    tools = [{"type": "function", "function": {"name": f"f{i}_{k}", "description": "a tool",
                                               "parameters": {"type": "object", "properties": dict(props[k::4]),
                                                              "required": [p for p, _ in props[k::4]]}}}
             for k in range(4)]
    return {"messages": [{"role": "user", "content": f"call one {i}"}], "tools": tools, "tool_choice": "required",
            "max_tokens": 4}


def test_health_answers_while_large_constrained_requests_are_prepared(server, monkeypatch):
    """/health keeps answering within milliseconds while eight chat requests of 900 KB with tool_choice
    required arrive at once: their preparation (the JSON, the tools' schemas, the tool-call grammar, the
    chat template) runs off the event loop."""
    monkeypatch.setattr(server.worker.engine.grammars, "compile_timeout_s", 0.5)
    bodies = [large_tool_body(i) for i in range(8)]
    latencies: list[float] = []
    done = threading.Event()

    def health():
        while not done.is_set():
            t0 = time.monotonic()
            with urllib.request.urlopen(f"{server.url}/health", timeout=60) as resp:
                resp.read()
            latencies.append(time.monotonic() - t0)
            time.sleep(0.01)

    with ThreadPoolExecutor(9) as pool:
        watcher = pool.submit(health)
        time.sleep(0.1)
        answers = [pool.submit(post, server, "/v1/chat/completions", b) for b in bodies]
        statuses = [a.result(300)[0] for a in answers]
        done.set()
        watcher.result(60)
    assert all(s in (200, 400) for s in statuses), statuses
    worst = max(latencies)
    assert worst < 0.5, f"/health took up to {worst * 1e3:.0f} ms while the requests were prepared"
