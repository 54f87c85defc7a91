"""The KV pool's size (engine/kv_pool.py) and max_model_len="auto": the model's context capped to what the
pool holds, resolved once while the pool is sized (one engine build)."""
from __future__ import annotations

import pytest

import engine.model_runner as model_runner
from engine import LLMEngine, RequestError, SamplingParams
from engine.config import Config, ConfigError
from engine.kv_pool import bytes_per_block

KW = dict(device="cpu", enforce_eager=True, kvcache_block_size=16, max_num_batched_tokens=64, max_num_seqs=4)


def build(model, monkeypatch, **kw) -> tuple[LLMEngine, list]:
    """An engine, and the list of model loads its build made."""
    loads = []
    real = model_runner.load_model
    monkeypatch.setattr(model_runner, "load_model", lambda m, path: loads.append(path) or real(m, path))
    return LLMEngine(str(model), **{**KW, **kw}), loads


@pytest.mark.parametrize("sizing", ["fixed", "budget"])
def test_auto_fits_the_context_to_a_small_pool_in_one_build(tiny_model_dir, monkeypatch, sizing):
    if sizing == "fixed":
        pool = dict(num_kvcache_blocks=4)
    else:                                               # sized from the CPU byte budget: room for 10 blocks
        cfg = Config(str(tiny_model_dir), **KW)
        pool = dict(cpu_kv_cache_bytes=10 * bytes_per_block(cfg, cfg.resolved_dtype("cpu")))
    eng, loads = build(tiny_model_dir, monkeypatch, max_model_len="auto", **pool)
    try:
        cfg = eng.config
        model_context = cfg.shape.max_position_embeddings
        pool_tokens = eng.stats().num_blocks * cfg.kvcache_block_size
        assert pool_tokens < model_context                  # the pool is the cap here
        assert cfg.max_model_len == min(pool_tokens, model_context) and cfg.max_model_len_auto
        assert len(loads) == 1                              # one build
        assert eng.describe()["config"]["max_model_len"] == cfg.max_model_len
        # admission and generation follow the fitted length
        with pytest.raises(RequestError) as e:
            eng.validate(list(range(1, cfg.max_model_len + 1)))
        assert e.value.code == "context_length_exceeded"
        out = eng.generate([list(range(1, cfg.max_model_len))], SamplingParams(max_tokens=1, temperature=0))
        assert len(out[0]["token_ids"]) == 1
    finally:
        eng.close()


def test_auto_keeps_the_model_context_when_the_pool_holds_it(tiny_model_dir, monkeypatch):
    eng, loads = build(tiny_model_dir, monkeypatch, max_model_len="auto")     # the 1 GiB CPU budget
    try:
        cfg = eng.config
        assert eng.stats().num_blocks * cfg.kvcache_block_size >= cfg.shape.max_position_embeddings
        assert cfg.max_model_len == cfg.shape.max_position_embeddings and len(loads) == 1
    finally:
        eng.close()


def test_an_integer_is_capped_by_the_model_only(tiny_model_dir, monkeypatch):
    eng, _ = build(tiny_model_dir, monkeypatch, max_model_len=10 ** 6, num_kvcache_blocks=4)
    try:
        assert eng.config.max_model_len == eng.config.shape.max_position_embeddings   # not by the pool
        assert not eng.config.max_model_len_auto
    finally:
        eng.close()
    for bad, says in ((None, "positive integer"), ("fit", '"auto"'), (0, "positive integer")):
        with pytest.raises(ConfigError, match=says):
            LLMEngine(str(tiny_model_dir), max_model_len=bad, **KW)
