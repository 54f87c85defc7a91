"""The runner's input building (ModelRunner.inputs, engine/step_inputs.py): the packed host-to-device copies,
and the scratch prefills of start-up (engine/warmup.py)."""
from __future__ import annotations

import pytest

import torch

from engine import SamplingParams
from engine.warmup import scratch_prefill


def test_to_inputs_views_hold_the_plan(tiny_engine):
    engine = tiny_engine(max_model_len=256, max_num_batched_tokens=256)
    a = engine.add_request(list(range(100, 140)), SamplingParams(max_tokens=3))
    b = engine.add_request(list(range(200, 210)), SamplingParams(max_tokens=3))
    engine.step()                                             # prefill both
    builder = engine.runner.inputs
    plan = builder.plan_decode([a, b])
    inputs = builder.to_inputs(plan)
    assert inputs.input_ids.tolist() == plan.input_ids and inputs.positions.tolist() == [40, 10]
    assert inputs.meta.slot_mapping.tolist() == plan.slot_mapping
    assert inputs.meta.context_lens.tolist() == [41, 11]
    assert inputs.meta.block_tables.tolist() == [a.block_table, b.block_table + [-1] * 2]
    assert inputs.meta.cu_seqlens_q is None
    c = engine.add_request(list(range(300, 333)), SamplingParams(max_tokens=3))
    engine.scheduler.schedule()                               # c's prefill: 33 new positions, nothing cached
    prefill = builder.to_inputs(builder.plan_prefill([c]))
    assert prefill.meta.cu_seqlens_q.tolist() == [0, 33] == prefill.meta.cu_seqlens_k.tolist()
    assert prefill.meta.block_tables is None and prefill.meta.context_lens is None
    engine.close()


def test_scratch_prefill_writes_nothing_and_reads_a_prefix(tiny_engine):
    engine = tiny_engine(max_model_len=256, max_num_batched_tokens=256)
    runner = engine.runner
    before = runner.kv_cache.clone()
    fresh = scratch_prefill(runner.inputs, 3, 20)
    assert fresh.meta.block_tables is None and fresh.meta.cu_seqlens_q.tolist() == [0, 20, 40, 60]
    prefix = scratch_prefill(runner.inputs, 2, 16, cached=8)
    assert prefix.meta.cu_seqlens_q.tolist() == [0, 8, 16] and prefix.meta.cu_seqlens_k.tolist() == [0, 16, 32]
    assert prefix.meta.block_tables.tolist() == [[0], [0]]
    for inputs in (fresh, prefix):
        assert (inputs.meta.slot_mapping == -1).all()
        assert runner.run_model(inputs).shape[0] == len(inputs.meta.seqlens_q)
    assert torch.equal(runner.kv_cache, before)               # nothing was written to the cache
    engine.close()


def test_slots_of_a_span_are_the_per_position_slots(tiny_engine):
    """plan_prefill takes a span's cache slots one block at a time (InputBuilder.slots): the same slots as
    one lookup per position, for spans inside a block, across blocks, and from a cached prefix on."""
    engine = tiny_engine(max_model_len=256, max_num_batched_tokens=256)
    seq = engine.add_request(list(range(100, 170)), SamplingParams(max_tokens=3))
    engine.scheduler.schedule()                               # 70 positions: 5 blocks of 16
    builder = engine.runner.inputs
    assert len(seq.block_table) == 5
    for start, end in ((0, 70), (0, 1), (3, 9), (15, 17), (16, 32), (31, 70), (69, 70)):
        assert builder.slots(seq, start, end) == [builder.slot(seq, p) for p in range(start, end)], (start, end)
    assert builder._host_tensor([], torch.int64).shape == (0,)
    assert builder._host_tensor([1, -1, 2 ** 40], torch.int64).tolist() == [1, -1, 2 ** 40]
    engine.close()


def test_the_decode_prologue_is_on_by_default_on_triton_in_the_step_model(monkeypatch):
    """The Triton backend in nano-vllm's step model takes the decode prologue with its prefetch unless
    LAB_DECODE_PROLOGUE says noprefetch or 0; another backend or mixed batches keep the plain route."""
    from types import SimpleNamespace

    from engine.levers import DECODE_PROLOGUE_ENV, decode_prologue_mode

    step_model, mixed = SimpleNamespace(mixed_batches=False), SimpleNamespace(mixed_batches=True)
    monkeypatch.delenv(DECODE_PROLOGUE_ENV, raising=False)
    assert decode_prologue_mode(step_model, "triton") == "prefetch"
    assert decode_prologue_mode(mixed, "triton") == ""
    monkeypatch.setenv(DECODE_PROLOGUE_ENV, "1")
    assert decode_prologue_mode(step_model, "triton") == "prefetch"
    assert decode_prologue_mode(step_model, "flash_attn") == decode_prologue_mode(step_model, "torch") == ""
    assert decode_prologue_mode(mixed, "triton") == ""
    monkeypatch.setenv(DECODE_PROLOGUE_ENV, "noprefetch")
    assert decode_prologue_mode(step_model, "triton") == "plain"
    monkeypatch.setenv(DECODE_PROLOGUE_ENV, "0")
    assert decode_prologue_mode(step_model, "triton") == ""


def test_enabling_the_fused_ops_sets_every_module_s_switches(tiny_engine, monkeypatch):
    """_enable_fused_ops (as on CUDA) turns on every module's fused kernels and hands each its GEMV rows and decode
    prologue mode, whatever else it switches (the split-K GEMM off here: its counters would need a GPU)."""
    pytest.importorskip("triton")
    engine = tiny_engine()
    runner = engine.runner
    monkeypatch.setattr(runner, "device", "cuda")     # undone before the fixture closes the engine
    assert runner._enable_fused_ops(gemv_rows=4, prologue="prefetch", skinny_rows=0)
    modules = list(runner.model.modules())
    with_prologue = [m for m in modules if hasattr(m, "decode_prologue")]
    assert len(with_prologue) == len(runner.model.model.layers), with_prologue
    assert all(m.decode_prologue == "prefetch" for m in with_prologue)
    assert all(m.gemv_rows == 4 for m in modules if hasattr(m, "gemv_rows"))
    assert all(m.fused for m in modules if hasattr(m, "fused"))


def test_the_levers_refuse_a_value_they_do_not_know_in_one_line(monkeypatch):
    """Every LAB_* lever refuses a value outside its choices (ConfigError naming them), whatever the backend; the
    decode layer is off unless LAB_DECODE_LAYER=1, and then on the Triton backend only."""
    from types import SimpleNamespace

    from engine.config import ConfigError
    from engine.levers import (DECODE_LAYER_ENV, DECODE_PROLOGUE_ENV, GEMV_ROWS_ENV, L2_PREFETCH_ENV,
                               PREFILL_AHEAD_ENV, decode_layer_on, decode_prologue_mode, gemv_rows_setting,
                               l2_prefetch_mode, prefill_ahead)

    conf = SimpleNamespace(mixed_batches=False, overlap=True)
    for env, read, bad, named in ((DECODE_PROLOGUE_ENV, lambda: decode_prologue_mode(conf, "torch"), "yes", "noprefetch"),
                                  (GEMV_ROWS_ENV, gemv_rows_setting, "9", "from 1 to 8"),
                                  (PREFILL_AHEAD_ENV, lambda: prefill_ahead(conf), "2", "prefill"),
                                  (DECODE_LAYER_ENV, lambda: decode_layer_on("torch"), "on", "1"),
                                  (L2_PREFETCH_ENV, lambda: l2_prefetch_mode(""), "1", "mlp, layer")):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ConfigError, match=f"{env}='{bad}'.*{named}"):
            read()
        monkeypatch.delenv(env)
    assert not decode_layer_on("triton")
    monkeypatch.setenv(DECODE_LAYER_ENV, "1")
    assert decode_layer_on("triton") and not decode_layer_on("torch")
    assert l2_prefetch_mode("prefetch") == "0"                  # off unless asked
    monkeypatch.setenv(L2_PREFETCH_ENV, "layer")
    assert l2_prefetch_mode("prefetch") == l2_prefetch_mode("plain") == "layer"
    assert l2_prefetch_mode("") == "0"                          # only through the decode prologue


def test_the_l2_prefetch_plan_gives_each_layer_the_weights_its_next_kernels_read(tiny_engine):
    """CausalLM.set_l2_prefetch: "mlp" gives each layer's attention its o, gate_up and down weights, "layer" the next
    layer's qkv weight too (the last layer has none after it), "0" none; describe() names the mode."""
    model = tiny_engine().runner.model
    layers = model.model.layers
    assert model.describe()["l2_prefetch"] == "0" and all(not l.self_attn.l2_prefetch for l in layers)
    for mode in ("mlp", "layer"):
        model.set_l2_prefetch(mode)
        for i, layer in enumerate(layers):
            want = [layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
            if mode == "layer" and i + 1 < len(layers):
                want.append(layers[i + 1].self_attn.qkv_proj.weight)
            got = layer.self_attn.l2_prefetch
            assert [t.data_ptr() for t in got] == [w.data_ptr() for w in want], (mode, i)
            assert all(t.shape == w.shape for t, w in zip(got, want))
        assert model.describe()["l2_prefetch"] == mode
    first = layers[0]
    two = sum(w.numel() * w.element_size() for w in (first.self_attn.o_proj.weight, first.mlp.gate_up_proj.weight))
    model.set_l2_prefetch("layer", budget=two)               # the weights in order while they fit
    assert [t.data_ptr() for t in first.self_attn.l2_prefetch] == [first.self_attn.o_proj.weight.data_ptr(),
                                                                    first.mlp.gate_up_proj.weight.data_ptr()]
    model.set_l2_prefetch("0")
    assert all(not l.self_attn.l2_prefetch for l in layers) and model.describe()["l2_prefetch"] == "0"


def test_fp8_decode_knobs_parse_refuse_and_apply_only_to_an_fp8_cache_on_triton(monkeypatch):
    """LAB_FP8_DECODE: key=value pairs to paged_decode's keyword arguments; an unknown key or value refused in one
    line whatever the engine; {} unless the cache is fp8 and the backend Triton's."""
    from types import SimpleNamespace

    from engine.config import ConfigError
    from engine.levers import FP8_DECODE_ENV, fp8_decode_knobs

    fp8, bf16 = SimpleNamespace(kv_cache_dtype="fp8"), SimpleNamespace(kv_cache_dtype="auto")
    monkeypatch.delenv(FP8_DECODE_ENV, raising=False)
    assert fp8_decode_knobs(fp8, "triton") == {}
    monkeypatch.setenv(FP8_DECODE_ENV, " warps=8, stages=4,page_tile=0,v_in_tile=0,maxnreg=128 ")
    assert fp8_decode_knobs(fp8, "triton") == {"num_warps": 8, "num_stages": 4, "page_tile": False,
                                               "fp8_v_in_tile": False, "max_registers": 128}
    assert fp8_decode_knobs(bf16, "triton") == fp8_decode_knobs(fp8, "torch") == {}
    monkeypatch.setenv(FP8_DECODE_ENV, "v_in_tile=1,maxnreg=none")
    assert fp8_decode_knobs(fp8, "triton") == {"fp8_v_in_tile": True, "max_registers": 0}      # 0: no cap
    for bad, named in (("warps=3", "warps='3'; expected one of 2, 4, 8, 16"), ("blocks=64", "'blocks' is not a knob"),
                       ("maxnreg=100", "multiple of 8"), ("stages", "stages=''")):
        monkeypatch.setenv(FP8_DECODE_ENV, bad)
        with pytest.raises(ConfigError, match=f"{FP8_DECODE_ENV}='{bad}'.*{named}"):
            fp8_decode_knobs(bf16, "torch")


def test_decode_knobs_parse_refuse_and_apply_only_to_a_model_dtype_cache_on_triton(monkeypatch):
    """LAB_DECODE: the split knobs too (block_n, page_tile, kv_per_prog, waves) as paged_decode's keyword arguments; an
    unknown key or value refused in one line whatever the engine; {} on an fp8 cache and off Triton; its spelling
    reads back to the same knobs."""
    from types import SimpleNamespace

    from engine.config import ConfigError
    from engine.levers import DECODE_ENV, decode_knobs, decode_knobs_text

    fp8, bf16 = SimpleNamespace(kv_cache_dtype="fp8"), SimpleNamespace(kv_cache_dtype="auto")
    monkeypatch.delenv(DECODE_ENV, raising=False)
    assert decode_knobs(bf16, "triton") == {}
    monkeypatch.setenv(DECODE_ENV, "kv_per_prog=4, page_tile=1,block_n=32,warps=8,stages=3,waves=4")
    want = {"kv_per_prog": 4, "page_tile": True, "block_n": 32, "num_warps": 8, "num_stages": 3, "waves": 4}
    assert decode_knobs(bf16, "triton") == want and decode_knobs(bf16, "triton")["page_tile"] is True
    assert decode_knobs(fp8, "triton") == decode_knobs(bf16, "torch") == {}
    monkeypatch.setenv(DECODE_ENV, decode_knobs_text(want))
    assert decode_knobs(bf16, "triton") == want
    monkeypatch.setenv(DECODE_ENV, "page_tile=0")
    assert decode_knobs(bf16, "triton") == {"page_tile": False}
    for bad, named in (("block_n=48", "block_n='48'; expected one of 16, 32, 64, 128"), ("maxnreg=128", "'maxnreg' is "
                       "not a knob"), ("kv_per_prog=3", "expected one of 1, 2, 4, 8"), ("waves", "waves=''")):
        monkeypatch.setenv(DECODE_ENV, bad)
        with pytest.raises(ConfigError, match=f"{DECODE_ENV}='{bad}'.*{named}"):
            decode_knobs(fp8, "torch")


def test_the_runner_puts_the_levers_decode_knobs_on_its_backend(monkeypatch):
    """ModelRunner hands LAB_DECODE's knobs to the Triton backend on a cache in the model's dtype and LAB_FP8_DECODE's
    on an e4m3 one; describe() reports each (the runner's fp8_decode and decode_knobs)."""
    from types import SimpleNamespace

    from engine.levers import DECODE_ENV, FP8_DECODE_ENV
    from engine.model_runner import ModelRunner

    monkeypatch.setenv(DECODE_ENV, "block_n=32,page_tile=1")
    monkeypatch.setenv(FP8_DECODE_ENV, "warps=8")
    for cache, want in (("auto", {"block_n": 32, "page_tile": True}), ("fp8", {"num_warps": 8})):
        runner = SimpleNamespace(attention_backend="triton", backend=SimpleNamespace(decode_knobs={}))
        ModelRunner._take_decode_knobs(runner, SimpleNamespace(kv_cache_dtype=cache))
        assert runner.backend.decode_knobs == want == (runner.decode_knobs or runner.fp8_decode)
    runner = SimpleNamespace(attention_backend="torch", backend=SimpleNamespace(decode_knobs={}))
    ModelRunner._take_decode_knobs(runner, SimpleNamespace(kv_cache_dtype="auto"))
    assert runner.backend.decode_knobs == runner.decode_knobs == {}


def test_the_triton_backend_hands_its_decode_knobs_to_every_paged_decode(monkeypatch):
    """ModelRunner puts LAB_FP8_DECODE's knobs on the backend; both decode routes (plain and the prologue) pass them
    to paged_decode, where a knob given wins over splits.py's default."""
    from types import SimpleNamespace

    pytest.importorskip("triton")
    from engine.attention import triton_backend as tb

    seen = []
    monkeypatch.setattr(tb.tk, "paged_decode", lambda *a, **kw: seen.append(kw))
    backend = object.__new__(tb.TritonAttention)
    backend.sm_count, backend.decode_knobs = 132, {"num_warps": 8, "max_registers": None}
    meta = SimpleNamespace(is_prefill=False, block_tables=None, context_lens=None, max_seqlen_k=8, decode_order=None)
    backend.forward(None, None, None, None, None, meta, 1.0)
    backend.decode_new(None, None, None, meta, 1.0)
    assert [{k: kw[k] for k in ("num_warps", "max_registers")} for kw in seen] == [backend.decode_knobs] * 2


def test_the_engine_refuses_to_start_when_a_layer_kernel_barrier_gave_up():
    """LAB_DECODE_LAYER=1: once the warm-up ran the layer kernel, a raised flag (a grid barrier that gave up) stops
    the start in one line; a lowered one lets it go on."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    import torch

    from engine.config import ConfigError
    from engine.layers.decode_layer import FLAG, layer_sync
    from engine.model_runner import ModelRunner

    sync = layer_sync(torch.device("cpu"))
    runner = SimpleNamespace(device="cpu")
    ModelRunner._check_decode_layer(runner)
    sync[FLAG] = 1
    try:
        with pytest.raises(ConfigError, match="LAB_DECODE_LAYER=1: a grid barrier .* gave up"):
            ModelRunner._check_decode_layer(runner)
    finally:
        sync[FLAG] = 0
