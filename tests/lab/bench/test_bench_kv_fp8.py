"""``labkit bench --kv-cache-dtype fp8``: the workloads that take it (nano-vllm, latency, step-budget), one-line
refusals for the rest, and the bound following the cache: the bench reads the KV bytes per value from the
engine's pool (engine.probe.kv_cache().element_size()), one byte with an FP8 cache, so decode attention's
bytes in decode_bound / step_bound halve against bf16's."""
from __future__ import annotations

import pytest

from labkit.bench.bound import step_bound
from labkit.bench.run import run_bench
from labkit.errors import UserError


APPLIES = "--kv-cache-dtype applies to --workload nano-vllm, latency, attention and step-budget"


@pytest.mark.parametrize("kw, message", [
    (dict(workload="gemv"), APPLIES),
    (dict(workload="nano-batches"), APPLIES),
    (dict(workload="attention", device="cpu"), "bench --workload attention needs CUDA"),
])
def test_bench_refuses_the_cache_dtype_where_it_does_not_apply(kw, message, tmp_path):
    with pytest.raises(UserError, match=message):
        run_bench(out=tmp_path / "x.json", kv_cache_dtype="fp8", **kw)
    with pytest.raises(UserError, match="--kv-cache-dtype must be auto or fp8, got 'int8'"):
        run_bench(out=tmp_path / "x.json", workload="nano-vllm", kv_cache_dtype="int8")


def test_the_bound_reads_the_pools_bytes_per_value(engine_factory):
    eng = engine_factory(kv_cache_dtype="fp8", kvcache_block_size=16, max_model_len=64)
    assert eng.probe.kv_cache().element_size() == 1
    shape = eng.config.shape
    fp8 = step_bound(shape, 2, eng.probe.kv_cache().element_size(), 256, 1024, 4000.0)
    bf16 = step_bound(shape, 2, 2, 256, 1024, 4000.0)
    assert fp8["kv_read_bytes"] * 2 == bf16["kv_read_bytes"] and fp8["weight_bytes"] == bf16["weight_bytes"]
    assert fp8["bound_ms_per_step"] < bf16["bound_ms_per_step"]


def test_generate_and_serve_take_the_cache_dtype(tiny_model_dir, tmp_path):
    from labkit.experiments.generate import run_generate
    from serve.entrypoints.launch import serve_args

    record = run_generate(token_ids="1,2,3,4,5", max_tokens=3, out=tmp_path / "g.json", model=str(tiny_model_dir),
                          device="cpu", block_size=16, kv_cache_dtype="fp8")
    assert record["engine"]["kv_cache"]["dtype"] == "float8_e4m3fn"
    assert record["engine"]["config"]["kv_cache_dtype"] == "fp8"
    assert serve_args("cpu", kv_cache_dtype="fp8")[0].kv_cache_dtype == "fp8"
    assert serve_args("cpu")[0].kv_cache_dtype == "auto"
