"""Issue 29 item 16, a newcomer's rough edges: --help at 80 columns (option names whole, no <bool> after a flag),
doctor --engine in GiB, the serve banner's TP size and max-model-len, and the TP shutdown that left a
"resource_tracker: leaked shared_memory" warning after a SIGTERM. (The bench serve table: tests/service/
test_bench_serve.py.)"""
from __future__ import annotations

import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner


def _help(cli_app, *args: str) -> str:
    return CliRunner().invoke(cli_app, [*args, "--help"], env={"COLUMNS": "80", "TERMINAL_WIDTH": ""}).output


@pytest.mark.parametrize("command", [("quick-walk",), ("serve",), ("bench",)])
def test_help_at_80_columns_keeps_option_names_and_hints_no_bool(cli_app, command):
    import typer

    out = _help(cli_app, *command)
    click_cmd = typer.main.get_command(cli_app)
    for name in command:
        click_cmd = click_cmd.commands[name]
    names = [o for p in click_cmd.params for o in (*p.opts, *getattr(p, "secondary_opts", [])) if o.startswith("--")]
    assert names and max(len(line) for line in out.splitlines()) <= 80, out
    words = set(re.findall(r"--[a-z0-9-]+", out))
    missing = [n for n in names if n not in words]
    assert not missing, (missing, out)                   # every option name appears whole (not "--max-num-batc…")
    assert "…" not in "".join(line[:40] for line in out.splitlines())
    assert "<bool>" not in out, out                      # a flag takes no value: --trace, never --trace true


def test_doctor_engine_rows_say_gib():
    from labkit.console.setup import doctor_engine_rows, gib

    budget = 3 * 2**30 + 2**29
    rows = doctor_engine_rows({"attention_backend": "torch", "dtype": "float32", "block_size": 256, "num_blocks": 7,
                               "bytes_per_block": 2**20, "mib_per_block": 1.0, "tokens_in_pool": 7 * 256,
                               "memory": {"kv_budget_bytes": budget}})
    assert rows["KV budget"] == gib(budget) and rows["KV budget"].startswith(f"{budget / 2**30:.3g} GiB")
    assert gib(5 * 2**20).endswith("(5 MiB)") and rows["weights"] == "n/a (CPU budget)"


def test_serve_banner_names_the_attention_backend_the_cache_and_the_step_model(tiny_model_dir):
    """The banner says what serves: the attention backend auto chose, the activations' and the cache's dtype, the
    step model, graphs and overlap, from the built engine's describe()."""
    from labkit.console.serving import serving_banner
    from serve.core.config import WorkerConfig
    from serve.core.front import ServedEngine
    from engine import LLMEngine

    engine = LLMEngine(str(tiny_model_dir), device="cpu", enforce_eager=True, attention_backend="torch",
                       max_model_len=256, mixed_batches=True)
    try:
        served = ServedEngine("cpu-real-engine", "cpu", {"path": "m"}, engine.describe(), engine.config, 9)
    finally:
        engine.close()
    worker = types.SimpleNamespace(served=served, config=WorkerConfig(max_active=8, queue_size=5), worker_id="w")
    rows = serving_banner(worker, None)
    assert rows["attention / dtype / KV cache"] == "torch / float32 / float32"
    assert rows["steps / graphs / overlap"] == "mixed / off / off"
    assert "lab levers" not in rows                          # none on by default


def test_serve_banner_names_the_lab_levers_away_from_their_defaults():
    from labkit.console.serving import lab_levers

    step_model = {"overlap": True, "mixed_batches": False}
    assert lab_levers({"config": step_model, "prefill_ahead": True, "decode_behind_prefill": False,
                       "prefill_behind_prefill": True, "admit_in_flight": True, "gemv_rows": 1}) == {}
    assert lab_levers({"config": step_model, "prefill_ahead": False, "decode_behind_prefill": False,
                       "gemv_rows": 8}) == {"lab levers": "LAB_PREFILL_AHEAD=0, LAB_GEMV_ROWS=8"}
    assert lab_levers({"config": step_model, "prefill_ahead": True, "decode_behind_prefill": True,
                       "gemv_rows": 0}) == {"lab levers": "LAB_PREFILL_AHEAD=1"}
    assert lab_levers({"config": step_model, "prefill_ahead": True, "decode_behind_prefill": False}) \
        == {"lab levers": "LAB_PREFILL_AHEAD=prefill"}
    # without the overlapped decode, or with mixed steps, there is nothing to launch ahead: no lever to name
    for conf in ({"overlap": False, "mixed_batches": False}, {"overlap": True, "mixed_batches": True}):
        assert lab_levers({"config": conf, "prefill_ahead": False, "decode_behind_prefill": False}) == {}
    # the decode prologue's route away from its default on the Triton backend, and the layer kernel
    triton = {"config": step_model, "prefill_ahead": True, "prefill_behind_prefill": True, "attention_backend": "triton",
              "admit_in_flight": True}
    assert lab_levers(triton | {"model": {"qk_norm_rope_kv": "decode-prologue", "decode_layer": False}}) == {}
    assert lab_levers(triton | {"model": {"qk_norm_rope_kv": "fused"}}) == {"lab levers": "LAB_DECODE_PROLOGUE=0"}
    assert lab_levers(triton | {"model": {"qk_norm_rope_kv": "decode-prologue-noprefetch", "decode_layer": True}}) \
        == {"lab levers": "LAB_DECODE_PROLOGUE=noprefetch, LAB_DECODE_LAYER=1"}
    assert lab_levers(triton | {"model": {"qk_norm_rope_kv": "decode-prologue", "l2_prefetch": "mlp"}}) \
        == {"lab levers": "LAB_L2_PREFETCH=mlp"}
    assert lab_levers(triton | {"model": {"qk_norm_rope_kv": "decode-prologue", "l2_prefetch": "0"}}) == {}
    assert lab_levers(triton | {"kv_cache": {"v_transposed": True}}) == {"lab levers": "LAB_FP8_V_T=1"}
    assert lab_levers(triton | {"attention_backend": "torch", "model": {"qk_norm_rope_kv": "fused"}}) == {}
    assert lab_levers(triton | {"fp8_decode": {"num_warps": 8, "fp8_v_in_tile": False, "max_registers": None}}) \
        == {"lab levers": "LAB_FP8_DECODE=warps=8,v_in_tile=0,maxnreg=none"}
    assert lab_levers(triton | {"decode_knobs": {"kv_per_prog": 4, "page_tile": True, "block_n": 32}}) \
        == {"lab levers": "LAB_DECODE=kv_per_prog=4,page_tile=1,block_n=32"}
    assert lab_levers(triton | {"admit_in_flight": False}) == {"lab levers": "LAB_ADMIT_IN_FLIGHT=0"}
    # where it does not apply (LAB_PREFILL_AHEAD=prefill) it is not named as off
    assert lab_levers(triton | {"admit_in_flight": False, "prefill_behind_prefill": False}) \
        == {"lab levers": "LAB_PREFILL_AHEAD=prefill"}


def test_serve_banner_shows_tp_size_and_max_model_len(tiny_model_dir):
    from labkit.console.serving import serving_banner
    from serve.core.config import WorkerConfig
    from serve.core.front import ServedEngine
    from engine import Config

    cfg = Config(model=str(tiny_model_dir), max_model_len=384, tensor_parallel_size=1)
    served = ServedEngine("cpu-real-engine", "cpu", {"path": "m", "synthetic": True}, {}, cfg, 9)
    worker = types.SimpleNamespace(served=served, config=WorkerConfig(max_active=8, queue_size=5), worker_id="w")
    rows = serving_banner(worker, None)
    assert rows["tensor parallel size"] == cfg.tensor_parallel_size and rows["max model len"] == cfg.max_model_len
    assert rows["max active / per request / queue"] == "8 / 6 / 5 requests"


def test_tp_close_wakes_ranks_within_a_bound_when_a_waiter_died():
    """Event.set() waits for every waiter to wake; a rank killed while waiting never does, so the old close hung
    there (and the shared memory was left to the resource tracker's "leaked" warning). The bounded wake returns."""
    from engine.tp_workers import TPWorkers

    ctx = multiprocessing.get_context("spawn")
    ev = ctx.Event()
    proc = ctx.Process(target=ev.wait, args=(60.0,), daemon=True)
    proc.start()
    for _ in range(200):                                  # until it sleeps inside the Event's condition
        if ev._cond._sleeping_count.get_value() if hasattr(ev._cond._sleeping_count, "get_value") else 0:
            break
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(5)
    t0 = time.monotonic()
    TPWorkers._wake_ranks(types.SimpleNamespace(events=[ev]), 0.5)
    assert time.monotonic() - t0 < 3.0


@pytest.mark.slow
def test_sigterm_to_the_serve_process_group_leaves_no_leaked_shared_memory(tiny_model_dir, tmp_path):
    """`labkit serve --tensor-parallel-size 2 --engine-process` and SIGTERM to its process group (what a terminal or
    a supervisor sends): exit 0, no resource_tracker warning, no segment left in /dev/shm. (~1 min on CPU; the TP
    part is covered fast by the test above.)"""
    import uuid

    # its own channel name, so a TP engine of a test running beside it (another pytest worker) is not counted
    name = f"labkit_tp_sigterm_{uuid.uuid4().hex[:10]}"
    shm = Path("/dev/shm") / name
    proc = subprocess.Popen([sys.executable, "-m", "labkit", "serve", "--model", str(tiny_model_dir), "--device", "cpu",
                             "--port", "0", "--no-event-log", "--tensor-parallel-size", "2", "--engine-process",
                             "--shm-name", name],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            cwd=tmp_path)
    try:
        for line in proc.stdout:
            if "ready:" in line:
                break
        served_with_it = shm.exists() or not Path("/dev/shm").is_dir()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = proc.stderr.read()
    assert proc.returncode == 0 and "leaked" not in err and "Traceback" not in err, err
    assert served_with_it, f"{shm} did not exist while the server ran"
    assert not shm.exists(), f"{shm} left behind"
