"""labkit doctor / check / run / model error paths through the real CLI (CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from labkit import checks, paths
from labkit.cli import app

REPO = Path(__file__).resolve().parents[3]


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def test_doctor_then_check(runs, tmp_path):
    out = tmp_path / "doctor.json"
    res = cli("doctor", "--out", str(out), "--device", "cpu")
    assert res.exit_code == 0, res.output
    rec = json.loads(out.read_text())
    assert rec["verdict"] == "PASS" and rec["kind"] == "cpu-real-engine" and rec["device"] == "cpu"
    assert rec["checkpoint"] == "setup.doctor"
    assert rec["facts"]["tensor_check"]["device"] == "cpu"
    assert "PASS" in res.output and "doctor.json" in res.output

    # `labkit check` judges the checkpoint's own path under runs/
    res = cli("check", "setup.doctor")
    assert res.exit_code == 0 and "NOT-RUN" in res.output
    res = cli("doctor", "--device", "cpu", "--json")
    assert res.exit_code == 0
    assert json.loads(res.stdout)["verdict"] == "PASS"
    assert (runs / "setup-doctor.json").is_file()
    res = cli("check", "setup.doctor", "--json")
    assert res.exit_code == 0
    rows = json.loads(res.stdout)
    assert [(r["id"], r["verdict"]) for r in rows] == [("setup.doctor", "PASS")]

    # a tampered file fails the re-judge, and `check` exits 1
    rec = json.loads((runs / "setup-doctor.json").read_text())
    rec["facts"]["tensor_check"]["max_abs_err"] = 0.5
    (runs / "setup-doctor.json").write_text(json.dumps(rec))
    res = cli("check", "setup.doctor")
    assert res.exit_code == 1 and "FAIL" in res.output


@pytest.mark.parametrize("shadow", [False, True], ids=["project-engine", "shadow-engine"])
def test_doctor_fails_when_import_engine_is_not_this_projects(tmp_path, shadow):
    """A package named `engine` ahead of ours on PYTHONPATH: doctor imports and runs the engine, so it
    FAILs (exit 1) instead of passing on packages and a matmul alone. The same call without the shadow
    passes, with the engine's one greedy token as evidence."""
    fake = tmp_path / "shadow" / "engine"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    path = ([str(fake.parent)] if shadow else []) + [str(REPO)]
    out = tmp_path / "doctor.json"
    proc = subprocess.run([sys.executable, "-m", "labkit", "doctor", "--device", "cpu", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(path),
                               paths.RUNS_DIR_ENV: str(tmp_path / "runs")})
    rec = json.loads(out.read_text())
    facts = rec["facts"]
    if shadow:
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert rec["verdict"] == "FAIL" and facts["engine_import"]["path"] == str(fake.resolve())
        failed = {c["name"] for c in rec["checks"] if not c["passed"]}
        assert {"facts.engine_import.inside_project", "facts.engine_run.output_tokens"} <= failed
        assert not facts["engine_run"]["ok"] and "SamplingParams" in facts["engine_run"]["error"]
    else:
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert rec["verdict"] == "PASS" and rec["kind"] == "cpu-real-engine"
        assert facts["engine_import"]["path"] == str((REPO / "engine").resolve())
        assert facts["engine_run"]["output_tokens"] == len(facts["engine_run"]["output_token_ids"]) == 1


def test_check_with_nothing_run_is_not_a_failure(runs):
    res = cli("check", "--json")
    assert res.exit_code == 0, res.output
    rows = json.loads(res.stdout)
    assert rows and {r["verdict"] for r in rows} == {"NOT-RUN"}
    assert all(r["reason"].startswith("no evidence at ") for r in rows)


def _assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stdout + proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    for f in fragments:
        assert f in lines[0]


def test_unknown_checkpoint_is_one_line(labkit_process):
    """The one real process of the one-line errors here (the two below run the same app in process)."""
    proc = labkit_process("check", "setup.doctr")
    _assert_one_line_error(proc, "unknown stage or checkpoint 'setup.doctr'", "setup.doctor")


def test_doctor_on_missing_cuda_is_one_line(labkit_in_process):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    proc = labkit_in_process("doctor", "--device", "cuda", "--out", os.devnull)
    _assert_one_line_error(proc, "CUDA is not available")


def test_model_inspect_missing_dir_is_one_line(labkit_in_process):
    pytest.importorskip("labkit.assets.identity")
    proc = labkit_in_process("model", "inspect", "/nonexistent/model-dir")
    _assert_one_line_error(proc, "/nonexistent/model-dir")


def test_run_one_checkpoint_writes_log_and_report(runs):
    from labkit.run_all import run_all

    rows = run_all(stage="setup.doctor", show_progress=False)
    assert [(r["id"], r["verdict"], r["exit_code"]) for r in rows] == [("setup.doctor", "PASS", 0)], rows
    assert Path(rows[0]["evidence"]) == runs / "setup-doctor.json"
    assert "labkit doctor --out" in (runs / "logs" / "setup.doctor.log").read_text()
    report = json.loads((runs / "report.json").read_text())
    assert report["counts"]["PASS"] == 1 and report["rows"][0]["id"] == "setup.doctor"
    assert "| `setup.doctor` | PASS |" in (runs / "report.md").read_text()


def test_run_marks_unavailable_hardware_not_run(runs, monkeypatch):
    import labkit.run_all as runner

    monkeypatch.setattr(runner, "machine", lambda: {"cuda_device_count": 0, "cuda_devices": []})
    cp = checks.Checkpoint(id="cuda.x", title="t", command=["labkit", "x"], evidence="runs/cuda-x.json",
                           needs="cuda", kind=["gpu-measured"], assertions=[], stage="cuda")
    assert runner.can_run(cp) == (False, "needs CUDA")
    cp.needs = "2gpu"
    assert runner.can_run(cp) == (False, "needs 2 GPUs")
    monkeypatch.setattr(runner, "machine", lambda: {"cuda_device_count": 2, "cuda_devices": ["a", "b"]})
    assert runner.can_run(cp) == (True, "")


def test_run_command_adds_model_only_where_taken():
    from labkit.run_all import build_command

    cp = checks.get_checkpoint("setup.doctor")
    cmd = build_command(cp, Path("/tmp/e.json"), model="/m")
    assert cmd[1:] == ["-m", "labkit", "doctor", "--out", "/tmp/e.json"]
    cp.takes_model = True
    assert build_command(cp, Path("/tmp/e.json"), model="/m")[-2:] == ["--model", "/m"]


def test_doctor_engine_reports_kv_pool_sizing(tiny_model_dir, tmp_path, labkit_argv):
    from labkit.doctor import run_doctor

    labkit_argv.checkpoint("setup.doctor", "--engine")

    rec = run_doctor(tmp_path / "doc.json", "cpu", engine=True, model=str(tiny_model_dir))
    e = rec["facts"]["engine"]
    # tiny preset, float32: 2 (K,V) x 2 layers x 256 positions x 2 kv heads x 16 dims x 4 bytes
    assert e["bytes_per_block"] == 2 * 2 * 256 * 2 * 16 * 4
    assert e["num_blocks"] > 0 and e["tokens_in_pool"] == e["num_blocks"] * 256
    assert rec["engine"]["num_kvcache_blocks"] == e["num_blocks"] and rec["verdict"] == "PASS"


def _stand_in(tmp_path, monkeypatch, name: str, script: str) -> None:
    """An executable `name` on PATH that runs `script` (sh)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    exe = bin_dir / name
    exe.write_text("#!/bin/sh\n" + script + "\n")
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_doctor_records_the_toolchain_nvidia_smi_and_nvcc(tmp_path, monkeypatch):
    """Handbook 5.1.4: nvidia-smi's index, name, uuid, memory and driver per GPU; nvcc's release line."""
    from labkit.doctor import nvcc_version, nvidia_smi

    _stand_in(tmp_path, monkeypatch, "nvidia-smi",
              'case "$1" in --query-gpu=index,name,uuid,memory.total,driver_version) ;; *) exit 9 ;; esac\n'
              'echo "0, NVIDIA H200, GPU-aaaa, 143771 MiB, 580.159.04"\n'
              'echo "1, NVIDIA H200, GPU-bbbb, 143771 MiB, 580.159.04"')
    _stand_in(tmp_path, monkeypatch, "nvcc", 'echo "nvcc: NVIDIA (R) Cuda compiler driver"; '
              'echo "Cuda compilation tools, release 13.0, V13.0.88"')
    smi = nvidia_smi()
    assert smi["available"] and smi["driver"] == "580.159.04"
    assert smi["gpus"][1] == {"index": "1", "name": "NVIDIA H200", "uuid": "GPU-bbbb", "memory": "143771 MiB",
                              "driver": "580.159.04"}
    assert nvcc_version()["release"] == "Cuda compilation tools, release 13.0, V13.0.88"
    _stand_in(tmp_path, monkeypatch, "nvidia-smi", 'echo "NVIDIA-SMI has failed" >&2; exit 9')
    _stand_in(tmp_path, monkeypatch, "nvcc", "exit 1")
    assert nvidia_smi() == {"available": False, "reason": "NVIDIA-SMI has failed"}
    assert nvcc_version()["available"] is False


def test_doctor_reviews_broken_requirements(tmp_path, labkit_argv, monkeypatch):
    """`pip check` reporting a broken requirement makes doctor REVIEW (the rest PASSes), and its machine table
    says what pip reported."""
    import labkit.doctor as doctor
    from labkit.console.setup import render_doctor

    labkit_argv.checkpoint("setup.doctor")
    assert doctor.pip_check() == {"ok": True, "problems": []}          # this interpreter's environment
    real = doctor._run

    def broken(args, timeout=60):
        if args[1:] == ["-m", "pip", "check"]:
            return 1, "foo 1.0 has requirement bar>=2, but you have bar 1.0.\n", ""
        return real(args, timeout)

    monkeypatch.setattr(doctor, "_run", broken)
    rec = doctor.run_doctor(tmp_path / "doc.json", "cpu")
    assert rec["facts"]["toolchain"]["pip_check"] == {"ok": False,
                                                     "problems": ["foo 1.0 has requirement bar>=2, but you have bar 1.0."]}
    assert rec["verdict"] == "REVIEW"
    assert [c["name"] for c in rec["checks"] if c["status"] != "pass"] == ["facts.toolchain.pip_check.ok"]
    from labkit.console import console
    with console.capture() as cap:
        render_doctor(rec)
    assert "foo 1.0 has requirement bar>=2" in cap.get()


def test_qwen3_block_is_28_mib_in_bf16():
    """Appendix B.1.5 / B.8.3: one 256-token block of Qwen3-0.6B across all layers is 28 MiB in BF16."""
    from labkit.assets.synth import PRESETS

    cfg = PRESETS["qwen3-0.6b"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    assert per_token == 112 * 1024 and per_token * 256 == 28 * 2**20
