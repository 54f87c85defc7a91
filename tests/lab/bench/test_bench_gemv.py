"""labkit bench --workload gemv (labkit/bench/gemv.py) on the CPU: the shapes it times are the engine's own
projection weights, the sweep's settings, the graph's call count and the step summary; the timing itself
needs CUDA (the interpreter test of ``config=`` is in tests/kernels/test_gemv_interp.py)."""
from __future__ import annotations

import pytest

from engine.config import ModelShape
from labkit.assets.synth import PRESETS
from labkit.bench import gemv as bench_gemv


@pytest.mark.parametrize("preset", ["tiny", "qwen3-0.6b", "qwen3-8b"])
def test_the_shapes_are_the_engine_s_projection_weights(preset):
    import torch

    from engine.models.qwen3 import Qwen3ForCausalLM

    cfg = PRESETS[preset]
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg, backend=None)
    layer = model.model.layers[0]
    weights = {"qkv": layer.self_attn.qkv_proj.weight, "o": layer.self_attn.o_proj.weight,
               "gate_up": layer.mlp.gate_up_proj.weight, "down": layer.mlp.down_proj.weight,
               "lm_head": model.lm_head.weight}
    shapes = bench_gemv.gemv_shapes(ModelShape.from_hf(cfg))
    assert set(shapes) == set(weights)
    for name, (n, k, mode) in shapes.items():
        assert (n, k) == tuple(weights[name].shape), (preset, name)
    assert [shapes[n][2] for n in ("qkv", "o", "gate_up", "down", "lm_head")] == \
        ["normed", "plain", "normed", "silu", "plain"]       # the prologues qwen3.py's one-token path asks for


def test_the_sweep_tries_tiles_within_bounds_and_the_current_one():
    from engine.layers.fused_kernels import NORM_WARPS
    from engine.layers.gemv import gemv_config

    for n, k, mode in [(6144, 4096, "normed"), (4096, 4096, "plain"), (1024, 3072, "silu"), (4096, 1024, "normed")]:
        current = bench_gemv.launched(gemv_config(n, k), mode)
        got = bench_gemv.candidates(n, k, mode, gemv_config(n, k))
        assert current in got and len(got) == len(set(got)) > 10
        assert all(bk <= k and 1024 <= bn * bk <= 65536 for bn, bk, w in got if (bn, bk, w) != current)
        assert {w for _, _, w in got} == ({NORM_WARPS} if mode == "normed" else {4, 8})
    # the normed GEMV launches a row's tile at NORM_WARPS with the same elements per thread
    assert bench_gemv.launched((16, 512, 4 * NORM_WARPS), "normed") == (4, 512, NORM_WARPS)
    assert bench_gemv.launched((16, 512, 8), "plain") == (16, 512, 8)


def test_graph_calls_and_the_step_summary():
    assert bench_gemv.graph_calls(4096, 4096, 36, 2) == 36
    head = bench_gemv.graph_calls(151936, 4096, 36, 2)          # 1.24 GB a call: six fit in 8 GiB
    assert head == (8 << 30) // (151936 * 4096 * 2) == 6
    rows = {"o": {"current": {"us": 10.0}, "weight_bytes": 2_000_000},
            "lm_head": {"current": {"us": 100.0}, "weight_bytes": 50_000_000}}
    s = bench_gemv.step_summary(rows, layers=3, roof_gbs=1000.0)
    # 3 layers of o and one head: 130 us for 56 MB, read at 1000 GB/s in 56 us
    assert s["gemv_us_per_step"] == 130.0 and s["weight_bytes_per_step"] == 56_000_000
    assert s["bound_us_per_step"] == 56.0 and s["share_of_roof"] == round(56 / 130, 3)


def test_a_shape_s_row_ranks_the_settings_and_flips_the_peel(monkeypatch):
    """_bench_shape with a made-up timer (the real one needs CUDA): µs = BLOCK_N + BLOCK_K / 1000 + warps / 100,
    +0.5 when the first chunk is peeled."""
    import torch

    from engine.layers.gemv import gemv_config, peel_first_chunk

    def fake(n, k, mode, weights, config, peel):
        return config[0] + config[1] / 1000 + config[2] / 100 + 0.5 * peel
    monkeypatch.setattr(bench_gemv, "_time_setting", fake)
    n, k = 4096, 4096
    row = bench_gemv._bench_shape(n, k, "plain", 36, torch.float32, 1000.0, sweep=True, device="meta")
    tries = bench_gemv.candidates(n, k, "plain", gemv_config(n, k))
    us = sorted(fake(n, k, "plain", None, c, peel_first_chunk(k, c[1])) for c in tries)
    assert row["tried"] == len(tries) and [b["us"] for b in row["best"]] == [round(u, 3) for u in us[:5]]
    current = row["current"]
    assert tuple(current["tile"]) == gemv_config(n, k) and current["peel"] == peel_first_chunk(k, current["tile"][1])
    assert row["current_rank"] == 1 + sorted(us).index(fake(n, k, "plain", None, gemv_config(n, k), current["peel"]))
    assert row["current_peel_flipped"]["peel"] is not current["peel"]
    assert [f["peel"] for f in row["best_peel_flipped"]] == [not b["peel"] for b in row["best"]]
    assert row["calls_per_graph"] == 36 and row["weight_bytes"] == n * k * 4
