"""`labkit bench --workload step-budget` on CPU (tiny model): the categories cover the profiled op time
exactly once, every GEMM role is attributed to its module, the bounds' bytes agree with bound.py's weight
bytes, and a graph replay's kernels take their eager twins' categories."""
from __future__ import annotations

from collections import Counter

import pytest

from labkit.bench import step_budget as sb
from labkit.bench.bound import category_bytes_flops, decode_weight_bytes

SPEC = dict(batch=3, context=24, warm=1, steps=2)


@pytest.fixture(scope="module")
def budget(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("step-budget") / "bench-step-budget.json"
    record = sb.run_step_budget(out, sb.BudgetSpec(**SPEC), model=str(tiny_model_dir), device="cpu",
                                attention="torch")
    return record


def _trace_steps(record):
    path = record["facts"]["passes"]["eager"]["profiled"]["trace"]
    events = sb.load_trace(path)
    items, spans = sb.trace_items(events, device_is_cuda=False)
    return events, sb.split_steps(items, spans)


def test_budget_record_passes_and_names_its_kind(budget):
    assert budget["kind"] == "cpu-real-engine"
    assert budget["verdict"] == "PASS", [c for c in budget["checks"] if c["status"] != "pass"]
    f = budget["facts"]
    assert f["workload"]["batch"] == SPEC["batch"] and f["passes"]["eager"]["profiled"]["steps"] == SPEC["steps"]
    assert f["passes"]["eager"]["timed"]["routes"] == ["eager"]
    # the profiled steps decode at the prompt length plus the decode steps run before them
    assert f["passes"]["eager"]["timed"]["mean_context"] > SPEC["context"]


def test_the_budget_table_names_the_attention_backend_it_measured(budget):
    """The rendered table's title names the attention backend (auto may take flash_attn where it is installed)."""
    from labkit.console import console

    with console.capture() as cap:
        sb.render_budget(budget)
    assert "attention torch" in cap.get().replace("\n", " ")


def test_categories_sum_to_the_profiled_op_time(budget):
    """Independently of the attribution: the top-level aten ops inside each step range, from the trace."""
    events, steps = _trace_steps(budget)
    ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"), key=lambda e: e["ts"])
    step_spans = sorted((e for e in events if e.get("name") == sb.STEP_RANGE), key=lambda e: e["ts"])
    assert len(step_spans) == SPEC["steps"] == len(steps)
    for span, step in zip(step_spans, steps):
        inside = [e for e in ops if span["ts"] <= e["ts"] <= span["ts"] + span["dur"]]
        top, end = [], float("-inf")
        for e in inside:
            if e["ts"] >= end:
                top.append(e)
                end = e["ts"] + e["dur"]
        total = sum(e["dur"] for e in top)
        assert sum(step["by_category_us"].values()) == pytest.approx(total, rel=1e-6)
    b = budget["facts"]["budget"]
    assert b["categories_sum_ms"] == pytest.approx(b["device_ms"], rel=1e-3)
    assert b["device_busy_ms"] + b["host_outside_ms"] == pytest.approx(b["step_ms_profiled"], rel=1e-3)


def test_every_gemm_role_is_attributed_to_its_module(budget, tiny_model_dir):
    import json

    layers = json.loads((tiny_model_dir / "config.json").read_text())["num_hidden_layers"]
    _, steps = _trace_steps(budget)
    for step in steps:
        linears = Counter(it.category for it in step["_items"] if it.name == "aten::linear")
        assert linears == {"gemm.qkv": layers, "gemm.o": layers, "gemm.gate_up": layers, "gemm.down": layers,
                           "gemm.lm_head": 1}
        assert step["by_category_us"]["other"] < 0.05 * step["device_us"]
    ms = budget["facts"]["budget"]["gemm_roles_ms"]
    assert set(ms) == set(sb.GEMM_ROLES) and all(v > 0 for v in ms.values())
    cats = budget["facts"]["passes"]["eager"]["profiled"]["by_category_ms"]
    for c in ("attention", "kv_store", "norm", "rotary", "activation", "embedding", "sampler"):
        assert cats[c] > 0, c


def test_hooks_are_removed_after_the_profiled_pass(tiny_model_dir):
    from labkit.lab_engine import build_engine

    built = build_engine(str(tiny_model_dir), "cpu", "torch")
    try:
        model = built.engine.runner.model
        before = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
        remove = sb.install_module_ranges(built.engine, sb._Ranges())
        assert sum(len(m._forward_pre_hooks) for m in model.modules()) == len(sb.module_categories(dict(model.named_modules())))
        assert "store_kv" in vars(built.engine.runner.backend)
        remove()
        assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == before
        assert "store_kv" not in vars(built.engine.runner.backend)
    finally:
        built.engine.close()


def test_the_one_token_normed_gemv_is_inside_its_gemm_role_range(tiny_model_dir):
    """The batch-1 path calls qkv_proj.normed / gate_up_proj.normed (the norm inside the GEMV), not forward: the
    budget wraps that method in its role's range (at batch 1 on CUDA these GEMVs were "other" without it)."""
    from labkit.lab_engine import build_engine

    class Recording(sb._Ranges):
        def enter(self, name):
            super().enter(name)
            seen.append(name)

    built = build_engine(str(tiny_model_dir), "cpu", "torch")
    try:
        layer = built.engine.runner.model.model.layers[0]
        seen, inside = [], []
        fake = lambda *a, **k: inside.append(seen[-1])              # noqa: E731 (stands for normed_gemv)
        for proj in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj):
            proj.normed = fake
        remove = sb.install_module_ranges(built.engine, Recording())
        layer.self_attn.qkv_proj.normed(None, None)
        layer.mlp.gate_up_proj.normed(None, None)
        remove()
        assert inside == [sb.RANGE + "gemm.qkv", sb.RANGE + "gemm.gate_up"]
        assert layer.self_attn.qkv_proj.normed is fake                 # unwrapped: the instance's own again
    finally:
        built.engine.close()


def test_bounds_bytes_at_batch_zero_are_the_decode_weight_bytes(tiny_model_dir):
    """At batch 0 only the weights are left: the categories' bytes add up to bound.decode_weight_bytes."""
    from engine.config import Config

    shape = Config(str(tiny_model_dir)).shape
    for fused in (True, False):
        parts = category_bytes_flops(shape, 2, 2, 0, 0.0, fused)
        assert sum(b for b, _ in parts.values()) == decode_weight_bytes(shape, 2)
    parts = category_bytes_flops(shape, 2, 2, 8, 100.0, True)
    h, inter, n = shape.hidden_size, shape.intermediate_size, shape.num_layers
    assert parts["gemm.down"][1] == 2 * 8 * inter * h * n
    assert parts["attention"][1] == 4 * 8 * 100 * shape.num_heads * shape.head_dim * n
    plain = category_bytes_flops(shape, 2, 2, 8, 100.0, False)
    # the fused q/k norm + RoPE kernel also stores the K/V: its bytes hold the store's, and no store row is left
    assert "kv_store" not in parts and plain["kv_store"][0] > 0
    assert parts["qk_norm_rope"][0] == plain["rotary"][0] + n * 2 * shape.head_dim * 2 + plain["kv_store"][0]
    doubled = category_bytes_flops(shape, 2, 2, 8, 200.0, True)
    kv_read = 8 * 100 * shape.kv_bytes_per_token(2)        # 100 more positions for each of 8 sequences
    assert doubled["attention"][0] - parts["attention"][0] == kv_read


def test_the_decode_prologue_counts_its_qk_norm_rope_and_store_in_attention(tiny_model_dir):
    """With the decode prologue the attention kernel norms, ropes and stores the new K/V: its kernels launch
    outside the attn module (named by kernel name) and its bound holds the fused kernel's bytes."""
    from engine.config import Config
    from labkit.bench.step_attribution import name_category

    assert name_category("_decode_split_kernel", "kernel") == "attention"
    assert name_category("_decode_reduce_kernel", "kernel") == "attention"
    assert name_category("_gemv_kernel", "kernel") == "other"
    shape = Config(str(tiny_model_dir)).shape
    fused = category_bytes_flops(shape, 2, 2, 8, 100.0, True)
    prologue = category_bytes_flops(shape, 2, 2, 8, 100.0, True, decode_prologue=True)
    assert "qk_norm_rope" not in prologue and "kv_store" not in prologue
    assert prologue["attention"][0] == fused["attention"][0] + fused["qk_norm_rope"][0]
    assert sum(b for b, _ in prologue.values()) == sum(b for b, _ in fused.values())


def test_the_decode_layer_holds_the_layers_bytes_and_flops(tiny_model_dir):
    """With the decode layer (one kernel a layer at batch 1) its kernel is the ``layer`` category, whose bound holds
    the projections', the attention's (with its prologue), the activation's and the norms' bytes and FLOPs; the LM
    head, embedding and sampler keep theirs, and the step's total is unchanged."""
    from engine.config import Config
    from labkit.bench.step_attribution import name_category

    assert name_category("_decode_layer_kernel", "kernel") == "layer"
    shape = Config(str(tiny_model_dir)).shape
    prologue = category_bytes_flops(shape, 2, 2, 1, 100.0, True, decode_prologue=True)
    layer = category_bytes_flops(shape, 2, 2, 1, 100.0, True, decode_prologue=True, decode_layer=True)
    assert set(layer) == {"layer", "gemm.lm_head", "embedding", "sampler"}, layer
    inside = ("gemm.qkv", "gemm.o", "gemm.gate_up", "gemm.down", "attention", "activation", "norm")
    assert layer["layer"] == (sum(prologue[c][0] for c in inside), sum(prologue[c][1] for c in inside))
    assert sum(b for b, _ in layer.values()) == sum(b for b, _ in prologue.values())


def test_graph_kernels_take_their_eager_twins_categories():
    eager = [sb.Item(name, float(i), 1.0, float(i), category=cat) for i, (name, cat) in enumerate(
        [("rms", "norm"), ("gemm", "gemm.qkv"), ("qk_norm_rope", "qk_norm_rope"), ("store", "kv_store"),
         ("decode", "attention"), ("gemm", "gemm.o"), ("gemm", "gemm.gate_up"), ("silu", "activation"),
         ("gemm", "gemm.down"), ("gemm", "gemm.lm_head")])]
    graph_names = ["rms", "gemm", "qk_norm_rope", "store", "decode", "reduce", "gemm", "gemm", "silu", "gemm", "gemm"]
    graph = [sb.Item(name, 100.0 + i, 2.0, 50.0, "cudaGraphLaunch", "kernel", category="other")
             for i, name in enumerate(graph_names)]
    share = sb.align_graph_step(graph, eager)
    assert [it.category for it in graph] == ["norm", "gemm.qkv", "qk_norm_rope", "kv_store", "attention", "other",
                                             "gemm.o", "gemm.gate_up", "activation", "gemm.down", "gemm.lm_head"]
    assert share == pytest.approx(10 / 11)


def test_innermost_ranges_follow_nesting():
    spans = [(0.0, 100.0, "budget.step"), (10.0, 50.0, "budget.phase:forward"), (12.0, 5.0, "budget:gemm.qkv"),
             (20.0, 10.0, "budget:attention"), (22.0, 2.0, "budget:kv_store"), (70.0, 20.0, "budget.phase:sample")]
    got = sb.innermost_spans(spans, [13.0, 23.0, 28.0, 40.0, 75.0, 95.0])
    assert [g[-1] for g in got] == ["budget:gemm.qkv", "budget:kv_store", "budget:attention",
                                    "budget.phase:forward", "budget.phase:sample", "budget.step"]


def test_cli_refuses_options_of_other_workloads(cli_app):
    from typer.testing import CliRunner

    r = CliRunner().invoke(cli_app, ["bench", "--workload", "step-budget", "--profile", "--device", "cpu"])
    assert r.exit_code == 2 and "--profile" in r.output
    r = CliRunner().invoke(cli_app, ["bench", "--workload", "nano-vllm", "--batch", "4", "--device", "cpu"])
    assert r.exit_code == 2 and "--batch applies to --workload step-budget, latency and nano-batches" in r.output
    r = CliRunner().invoke(cli_app, ["bench", "--workload", "latency", "--context", "4", "--device", "cpu"])
    assert r.exit_code == 2 and "step-budget" in r.output


def test_cuda_trace_items_follow_their_launch_to_the_module_range():
    """The CUDA path on a trace in kineto's layout: a kernel takes the range around the host call that
    launched it (correlation id), a memcpy is a copy, a graph replay's kernels are marked as such."""
    def x(cat, name, ts, dur, **args):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": 1, "pid": 1, "args": args}

    events = [x("user_annotation", sb.STEP_RANGE, 0, 100), x("user_annotation", "budget.phase:forward", 5, 60),
              x("user_annotation", "budget:gemm.o", 10, 5), x("cuda_runtime", "cudaLaunchKernel", 11, 1, correlation=1),
              x("user_annotation", "budget:attention", 20, 10), x("cuda_driver", "cuLaunchKernel", 21, 1, correlation=2),
              x("cuda_runtime", "cudaGraphLaunch", 40, 2, correlation=3),
              x("user_annotation", "budget.phase:sample", 70, 20), x("cuda_runtime", "cudaLaunchKernel", 71, 1, correlation=4),
              x("cuda_runtime", "cudaMemcpyAsync", 80, 1, correlation=5),
              x("kernel", "sm90_gemm", 30, 4, correlation=1), x("kernel", "_decode_split_kernel", 35, 6, correlation=2),
              x("kernel", "_rms_norm_kernel", 45, 2, correlation=3), x("kernel", "sm90_gemm", 48, 3, correlation=3),
              x("kernel", "_gumbel_argmax_kernel", 75, 2, correlation=4), x("gpu_memcpy", "Memcpy DtoH", 82, 1, correlation=5),
              x("kernel", "stray", 200, 1, correlation=99)]
    items, spans = sb.trace_items(events, device_is_cuda=True)
    by_name = [(it.name, it.category, sb.is_graph_launch(it)) for it in sorted(items, key=lambda it: it.start)]
    assert by_name == [("sm90_gemm", "gemm.o", False), ("_decode_split_kernel", "attention", False),
                       ("_rms_norm_kernel", "other", True), ("sm90_gemm", "other", True),
                       ("_gumbel_argmax_kernel", "sampler", False), ("Memcpy DtoH", "copies", False)]
    (step,) = sb.split_steps(items, spans)
    assert step["device_us"] == 18 and step["busy_us"] == 18
    assert step["host_outside_total_us"] == 100 - 18
    assert step["host_outside_us"]["forward"] == 60 - (4 + 6 + 2 + 3) and step["host_outside_us"]["sample"] == 20 - 3


def test_eager_decode_sets_the_graphs_aside_and_brings_them_back(tiny_model_dir):
    from labkit.lab_engine import build_engine

    built = build_engine(str(tiny_model_dir), "cpu", "torch")
    engine = built.engine
    try:
        captured = object()                 # stands for the captured graphs (none on CPU)
        engine.runner.graphs = captured
        with engine.eager_decode():
            assert engine.runner.graphs is None and not engine.describe()["graph"]["enabled"]
        assert engine.runner.graphs is captured
        with pytest.raises(RuntimeError), engine.eager_decode():
            raise RuntimeError("a failing pass")
        assert engine.runner.graphs is captured
    finally:
        engine.runner.graphs = None
        engine.close()


def test_budget_rows_carry_each_categorys_bound(budget, tiny_model_dir, monkeypatch):
    """The CUDA branch of the table on this run's passes, with the roofs given: bound = max(bytes / roof,
    FLOPs / peak), share of bound = bound / measured."""
    import labkit.bench.timing as timing
    from labkit.lab_engine import build_engine

    monkeypatch.setattr(timing, "copy_roof_gbs", lambda: 100.0)
    monkeypatch.setattr(timing, "matmul_peak_tflops", lambda dtype="bfloat16": 0.05)
    built = build_engine(str(tiny_model_dir), "cpu", "torch", max_num_seqs=SPEC["batch"])
    try:
        table = sb.budget_table(budget["facts"]["passes"], "eager", "eager", built.engine, "cuda")
    finally:
        built.engine.close()
    rows = {r["category"]: r for r in table["rows"]}
    assert table["roofs"] == {"copy_roof_gb_s": 100.0, "matmul_peak_tflops": 0.05}
    lm = rows["gemm.lm_head"]
    shape = built.engine.config.shape
    flops = 2 * SPEC["batch"] * shape.hidden_size * shape.vocab_size
    nbytes = 4 * (shape.vocab_size * shape.hidden_size + SPEC["batch"] * (shape.hidden_size + shape.vocab_size))
    assert lm["bound_ms"] == pytest.approx(max(flops / 0.05e12, nbytes / 100e9) * 1e3, rel=1e-3)
    assert lm["achieved_share_of_bound"] == pytest.approx(lm["bound_ms"] / lm["ms_per_step"], rel=1e-3)
    assert {"attention", "kv_store", "sampler", "rotary"} <= {c for c, r in rows.items() if "bound_ms" in r}


def test_with_the_layer_kernel_its_category_stands_for_the_four_projections(budget):
    """LAB_DECODE_LAYER=1 runs qkv, o, gate_up and down inside one kernel: their GEMM roles see nothing and the
    "layer" category must have run instead; without it every role must have been attributed."""
    import copy

    from labkit.checks import evaluate, verdict
    from labkit.checks.language import parse_run_assertions

    def judged(facts, layer_kernel):
        assertions = parse_run_assertions(sb.budget_assertions(graph=False, layer_kernel=layer_kernel))
        checks = [evaluate(a, {"facts": facts}) for a in assertions]
        return verdict(checks), {c["name"] for c in checks if c["status"] == "fail"}

    facts = copy.deepcopy(budget["facts"])
    assert judged(facts, False) == ("PASS", set()) and facts["budget"]["layer_ms"] == 0.0
    layered = copy.deepcopy(facts)
    layered["budget"]["gemm_roles_ms"].update({r: 0.0 for r in sb.LAYER_ROLES})
    layered["budget"]["layer_ms"] = 0.5
    assert judged(layered, True) == ("PASS", set())
    assert judged(layered, False)[1] == {f"GEMM role {r} attributed" for r in sb.LAYER_ROLES}
    layered["budget"]["layer_ms"] = 0.0                       # the lever on and no layer kernel seen
    assert judged(layered, True) == ("FAIL", {"layer kernel attributed"})
