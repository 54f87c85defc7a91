"""``labkit principles residual`` (handbook B.3, figure B-4): layer 0's residual path recomputed by hand.

The course writes one decoder layer as h = x + Attn(Norm1(x)), y = h + MLP(Norm2(h)). The engine does not
keep y: a layer returns two tensors, the MLP's output and the residual stream h, and the next RMSNorm adds
them (``RMSNorm.forward(x, residual)``: the fused add-and-norm). This walk runs a prompt through the real
engine with a read-only forward hook on layer 0 (``EngineProbe.named_modules``) and, inside the hook, with
the step's own inputs (positions, the embedding x, the attention metadata), recomputes

    a = self_attn(input_layernorm(x));  h = x + a;  m = mlp(post_attention_layernorm(h));  y = h + m

with the layer's own modules, then compares h with the residual the layer returned, m with the output it
returned, and y with what the next norm (layer 1's input_layernorm, or the final norm of a one-layer
model) makes of the pair. Controls drop the skips (y' = MLP(Norm2(a)), and y' = a + MLP(Norm2(a))) to
show how far a missing add moves y. Where the add happens is read from the engine's source.

Re-running self_attn writes the step's K/V to the same slots again; the probe puts back what the engine wrote.
"""
from __future__ import annotations

import inspect
from contextlib import contextmanager
from pathlib import Path

from engine import SamplingParams
from labkit.evidence import write_claimed
from labkit.lab_engine import build_engine, synthetic_note

PROMPT = tuple(range(1000, 1016))      # 16 token ids: one prefill of T=16, then one decode of T=1
MAX_TOKENS = 2


def _rel(a, b) -> float:
    """max |a - b| / max |b| (0 when both are 0)."""
    scale = float(b.float().abs().max())
    diff = float((a.float() - b.float()).abs().max())
    return diff / scale if scale else diff


@contextmanager
def _cache_kept(attn, slot_mapping):
    """Re-running self_attn writes the step's K/V into the paged cache again; put back what the engine wrote
    (on a GPU a one-token step's hand-made K/V can differ from the fused path's in the last bf16 bit)."""
    caches = [c.view(-1, *c.shape[-2:]) for c in (attn.k_cache, attn.v_cache) if c.numel()]
    slots = slot_mapping[slot_mapping >= 0].long()
    saved = [c[slots].clone() for c in caches]
    try:
        yield
    finally:
        for c, rows in zip(caches, saved):
            c[slots] = rows


class ResidualProbe:
    """Forward hook on layer 0 that recomputes its residual path by hand, once per engine step."""

    def __init__(self, engine):
        mods = dict(engine.probe.named_modules())
        self.layer = mods["model.layers.0"]
        self.next_norm = mods["model.layers.1.input_layernorm"] if "model.layers.1" in mods else mods["model.norm"]
        self.next_norm_name = "model.layers.1.input_layernorm" if "model.layers.1" in mods else "model.norm"
        self.steps: list[dict] = []
        self.handle = self.layer.register_forward_hook(self._hook)

    def _hook(self, layer, args, output) -> None:
        positions, x, residual_in, meta = args[:4]
        mlp_out, h_engine = output
        with _cache_kept(layer.self_attn.attn, meta.slot_mapping):
            a = layer.self_attn(positions, layer.input_layernorm(x), meta)
        h = x + a
        m = layer.mlp(layer.post_attention_layernorm(h))
        y = h + m
        _, y_engine = self.next_norm(mlp_out, h_engine)      # the next norm's residual add
        m_no_skip = layer.mlp(layer.post_attention_layernorm(a))       # h' = a: the attention skip dropped
        self.steps.append({
            "T": int(x.shape[0]), "layer_input_residual": None if residual_in is None else list(residual_in.shape),
            "x": list(x.shape), "h": list(h_engine.shape), "mlp_out": list(mlp_out.shape),
            "h_rel_diff": _rel(h, h_engine),          # hand h vs the residual stream the layer returned
            "mlp_rel_diff": _rel(m, mlp_out),         # hand MLP(Norm2(h)) vs the layer's output
            "y_rel_diff": _rel(y, y_engine),          # hand h + MLP vs the next norm's sum
            # controls: how far y moves when a skip is dropped (what the comparisons above would see)
            "without_skips_rel_diff": _rel(m_no_skip, y_engine),            # y' = MLP(Norm2(Attn(Norm1(x))))
            "without_attention_skip_rel_diff": _rel(a + m_no_skip, y_engine),   # y' = a + MLP(Norm2(a))
        })

    def close(self) -> None:
        self.handle.remove()


def _where(obj, needle: str) -> dict:
    """The file (repo-relative), line and text of the first source line of ``obj`` that contains ``needle``."""
    lines, start = inspect.getsourcelines(obj)
    path = Path(inspect.getsourcefile(obj)).resolve()
    root = Path(__import__("engine").__file__).resolve().parents[1]
    for i, line in enumerate(lines):
        if needle in line:
            return {"file": str(path.relative_to(root)), "function": obj.__qualname__, "line": start + i,
                    "source": line.strip()}
    return {"file": str(path.relative_to(root)), "function": obj.__qualname__, "line": None, "source": None}


def residual_sites() -> dict:
    """Where the engine adds the residual: the norm's add, and the decoder layer's calls that hand it over."""
    from engine.models.qwen3 import Qwen3DecoderLayer, Qwen3Model
    from engine.layers.layernorm import RMSNorm

    return {
        "norm_add": _where(RMSNorm.forward, "x + residual"),
        "norm_fused_kernel": _where(RMSNorm.forward, "rms_norm(x, self.weight, self.eps, residual)"),
        "attention_residual": _where(Qwen3DecoderLayer.forward, "self.input_layernorm(x, residual)"),
        "mlp_residual": _where(Qwen3DecoderLayer.forward, "self.post_attention_layernorm(x, residual)"),
        "final_residual": _where(Qwen3Model.forward, "self.norm(x, residual)"),
    }


def residual_facts(engine, probe: ResidualProbe) -> dict:
    steps = probe.steps
    worst = {k: max(s[k] for s in steps) for k in ("h_rel_diff", "mlp_rel_diff", "y_rel_diff")} if steps else {}
    sites = residual_sites()
    return {
        "formula": "h = x + Attn(Norm1(x)); y = h + MLP(Norm2(h)) (layer 0, by hand from its own modules)",
        "prompt_len": len(PROMPT), "max_tokens": MAX_TOKENS,
        "next_norm": probe.next_norm_name,
        "steps": steps,
        "steps_checked": len(steps),
        "T_per_step": [s["T"] for s in steps],
        "worst": worst,
        "without_skips_min_rel_diff": min(s["without_skips_rel_diff"] for s in steps) if steps else None,
        "sites": sites,
        "sites_found": all(s["line"] is not None for s in sites.values()),
        "norm_fused": bool(getattr(probe.layer.input_layernorm, "fused", False)),
        "note": "the layer returns (MLP output, h); y = h + MLP output is formed by the next RMSNorm's residual "
                "add, which is where the engine's fused norm adds the residual",
    }


def run_residual(out: Path | None = None, model: str | None = None, device: str = "auto",
                 attention: str = "auto") -> dict:
    built = build_engine(model, device, attention)
    engine = built.engine
    probe = ResidualProbe(engine)
    try:
        engine.add_request(list(PROMPT), SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
        while not engine.is_finished():
            engine.step()
    finally:
        probe.close()
    facts = residual_facts(engine, probe)
    facts["model_note"] = synthetic_note(built.model)
    record = write_claimed("principles.residual", out, "residual.json", kind=built.kind, facts=facts,
                           device=built.device, model=built.model, seed=engine.config.seed, engine=built.describe())
    engine.close()
    return record
