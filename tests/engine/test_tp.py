"""Tensor parallel on CPU (gloo): TP=2 equals TP=1, two TP engines side by side, a dead rank is reported."""
import os
import signal
import time

import pytest
import torch

from engine import LLMEngine, SamplingParams

TP_TOLERANCE = 5e-5      # float32; measured worst 1.7e-5 on the tiny model, 2.1e-5 on another run; an
                         # all-reduce that scales its sum by 1.001 gives 9.3e-5, which 1e-4 let pass


def forced_rows(engine, prompts, conts):
    from labkit.guardrails.forcing import teacher_forced
    return teacher_forced(engine, prompts, conts)


@pytest.fixture(scope="module")
def workload():
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 150000, (n,), generator=g).tolist() for n in (3, 70, 33, 140)]
    conts = [torch.randint(0, 150000, (4,), generator=g).tolist() for _ in prompts]
    return prompts, conts


def engine(model_dir, tp, **kw):
    return LLMEngine(str(model_dir), device="cpu", kvcache_block_size=16, max_num_batched_tokens=64,
                     tensor_parallel_size=tp, **kw)


@pytest.fixture(scope="module")
def tp2_pair(tiny_model_dir):
    """Two TP=2 engines with the default dist_init and shm_name, built once for the module (each spawns a rank
    process): the first is the TP=2 side of the TP=1 comparison, both are the two engines side by side."""
    a = engine(tiny_model_dir, 2)
    try:
        b = engine(tiny_model_dir, 2)
    except BaseException:
        a.close()
        raise
    yield a, b
    a.close()
    b.close()


def test_tp2_logits_equal_tp1(tiny_model_dir, workload, tp2_pair):
    e1, e2 = engine(tiny_model_dir, 1), tp2_pair[0]
    try:
        rows1, rows2 = forced_rows(e1, *workload), forced_rows(e2, *workload)
        assert len(rows1) == len(rows2) == 16
        worst = max((a[1] - b[1]).abs().max().item() for a, b in zip(rows1, rows2))
        assert [a[0] for a in rows1] == [b[0] for b in rows2]
        print(f"TP=2 vs TP=1 worst max-abs logit error: {worst:.3e}")
        assert worst < TP_TOLERANCE
        assert e2.runner.num_kvcache_blocks == e1.runner.num_kvcache_blocks
    finally:
        e1.close()


def test_two_tp2_engines_at_once(tp2_pair):
    a, b = tp2_pair
    ta, tb = a.describe()["tensor_parallel"], b.describe()["tensor_parallel"]
    assert ta["dist_init"] != tb["dist_init"] and ta["shm_name"] != tb["shm_name"]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    sa = a.add_request(list(range(500, 540)), sp)
    sb = b.add_request(list(range(500, 540)), sp)
    while not (a.is_finished() and b.is_finished()):     # interleaved steps of both engines
        if not a.is_finished():
            a.step()
        if not b.is_finished():
            b.step()
    assert sa.completion_token_ids == sb.completion_token_ids and len(sa.completion_token_ids) == 6


@pytest.fixture(scope="module")
def custom_tp2(tiny_model_dir):
    """One TP=2 engine on a dist_init and shm_name of the test's own (and tp_timeout_s 20), for the two tests that
    read its settings and kill its rank (in that order: the second ends it)."""
    from engine.tp_workers import free_port
    port = free_port()
    names = {"dist_init": f"tcp://127.0.0.1:{port}", "shm_name": f"labkit_test_{os.getpid()}"}
    e = engine(tiny_model_dir, 2, tp_timeout_s=20, **names)
    yield e, names
    e.close()


def test_custom_dist_init_and_shm_name(custom_tp2):
    e, names = custom_tp2
    tp = e.describe()["tensor_parallel"]
    assert tp["dist_init"] == names["dist_init"] and tp["shm_name"] == names["shm_name"]


def test_a_killed_rank_is_reported_not_hung(custom_tp2):
    e, _ = custom_tp2
    try:
        e.add_request(list(range(10, 30)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        e.step()
        worker = e.runner.workers.procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(5)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 1 .* exited"):
            e.step()
        assert time.monotonic() - t0 < 5
    finally:
        e.close()
        e.close()                      # exit is idempotent
    assert not any(p.is_alive() for p in e.runner.workers.procs)


def test_a_script_without_a_main_guard_fails_at_once_and_says_why(tiny_model_dir, tmp_path):
    """Ranks start with spawn, which re-runs the main script: without `if __name__ == "__main__":` rank 1 dies
    bootstrapping. Rank 0 sees it while it waits for the ranks to join, instead of waiting tp_timeout_s (120 s)
    for a rank that will never come and then failing on a store timeout."""
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text("from engine import LLMEngine\n"
                      f"LLMEngine({str(tiny_model_dir)!r}, device='cpu', tensor_parallel_size=2, kvcache_block_size=16, "
                      "max_num_batched_tokens=64)\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=110)
    assert r.returncode != 0
    assert "exited with code 1 before it joined rank 0" in r.stderr and 'if __name__ == "__main__":' in r.stderr
    assert time.monotonic() - t0 < 60


def test_bad_dist_init_is_one_clear_error(tiny_model_dir):
    with pytest.raises(ValueError, match="tcp://"):
        engine(tiny_model_dir, 2, dist_init="127.0.0.1:1")
