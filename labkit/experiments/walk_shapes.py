"""``labkit quick-walk --case A..D --shapes``: the model-internal shapes of every engine step (handbook 5.2.1
case A, B.3 step 3) and the rows the LM head read.

Read-only forward hooks on the engine's model (``EngineProbe.named_modules``): the embedding's output, every
decoder layer's attention inputs (q, k, v as the backend receives them), the model's final hidden states
and the LM head. Each shape is compared with the one the model's own config gives for the step's T (input
positions) and N (sequences): embedding [T, hidden], Q [T, heads, head_dim], K/V [T, kv_heads, head_dim],
logits [N, vocab]. The rows the LM head read are found by matching its input rows against the final
hidden states (measured, not computed from cu_seqlens), then compared with ``cu_seqlens_q[1:] - 1`` on a
prefill step and with 0..N-1 on a decode step.
"""
from __future__ import annotations

import re

_ATTN = re.compile(r"model\.layers\.(\d+)\.self_attn\.attn")
_NAMED = {"embed": "model.embed_tokens", "final_hidden": "model", "logits": "lm_head"}


class LayerShapeProbe:
    """Forward hooks that record each step's shapes; subscribe it to the engine's events (it learns the
    step number from the ``scheduled`` event) and ``close()`` it after the walk."""

    def __init__(self, engine):
        self.step = 0
        self.shapes: dict[int, dict] = {}
        self.lm_head_rows: dict[int, list[int]] = {}
        self._hidden = None
        modules = dict(engine.probe.named_modules())
        missing = [n for n in _NAMED.values() if n not in modules]
        layers = sorted((int(m.group(1)), name) for name in modules if (m := _ATTN.fullmatch(name)))
        if missing or not layers:
            raise RuntimeError(f"the model has no module {(missing or ['model.layers.N.self_attn.attn'])[0]!r}")
        self.num_layers = len(layers)
        hooks = [(modules[name], self._named(key)) for key, name in _NAMED.items()]
        hooks += [(modules[name], self._attention(i)) for i, name in layers]
        self.handles = [module.register_forward_hook(hook) for module, hook in hooks]

    def __call__(self, event) -> None:
        if event.name == "scheduled":
            self.step = event.step

    def _here(self) -> dict:
        return self.shapes.setdefault(self.step, {"layers": {}})

    def _named(self, key: str):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            self._here()[key] = list(out.shape)
            if key == "final_hidden":
                self._hidden = out.detach()
            elif key == "logits" and self._hidden is not None:
                self.lm_head_rows[self.step] = [row_index(self._hidden, r) for r in args[0].detach()]
        return hook

    def _attention(self, index: int):
        def hook(module, args, output):
            q, k, v = args[:3]
            self._here()["layers"][index] = {"q": list(q.shape), "k": list(k.shape), "v": list(v.shape)}
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def row_index(hidden, row) -> int:
    """The index of the one row of ``hidden`` equal to ``row`` (-1: none, or more than one)."""
    import torch

    hits = torch.nonzero((hidden == row).all(dim=-1)).flatten().tolist()
    return hits[0] if len(hits) == 1 else -1


def expected_shapes(model: dict, t: int, n: int) -> dict:
    """The shapes the model's config gives a step of ``t`` input positions and ``n`` sequences."""
    return {"embed": [t, model["hidden"]], "q": [t, model["q_heads"], model["head_dim"]],
            "k": [t, model["kv_heads"], model["head_dim"]], "v": [t, model["kv_heads"], model["head_dim"]],
            "logits": [n, model["vocab"]]}


def _step_facts(st: dict, got: dict, rows: list[int] | None, model: dict) -> tuple[dict, list[dict]]:
    """One step's shapes, the rows its LM head read, and where a shape is not the config's."""
    t, n = st["inputs"]["input_shape"][0], len(st["before"])
    want = expected_shapes(model, t, n)
    layers = [got["layers"].get(i) for i in range(model["layers"])]
    bad = [{"step": st["step"], "what": key, "shape": got.get(key), "config": want[key]}
           for key in ("embed", "logits") if got.get(key) != want[key]]
    for i, layer in enumerate(layers):
        for key in ("q", "k", "v"):
            if (layer or {}).get(key) != want[key]:
                bad.append({"step": st["step"], "what": f"layer {i} {key}", "shape": (layer or {}).get(key),
                            "config": want[key]})
    cu = st["inputs"]["cu_seqlens_q"]
    last = [c - 1 for c in cu[1:]] if st["phase"] == "prefill" and cu else list(range(n))
    firsts = {s[0] for s in [got.get("embed")] + [(layer or {}).get(k) for layer in layers for k in "qkv"] if s}
    return {
        "step": st["step"], "phase": st["phase"], "T": t, "N": n,
        "tokens_in_shapes": firsts.pop() if len(firsts) == 1 else None,   # the first dim every tensor shares
        "embed": got.get("embed"), "logits": got.get("logits"),
        "layers_recorded": sum(layer is not None for layer in layers),
        "layer0": layers[0] if layers else None,
        "layers_same_as_layer0": all(layer == layers[0] for layer in layers),
        "cu_seqlens_q": cu,
        "lm_head_rows": rows,
        "rows_by_rule": last,        # cu_seqlens_q[1:] - 1 (prefill), every row (decode)
        "lm_head_rows_follow_rule": rows == last,
    }, bad


def shape_facts(probe: LayerShapeProbe, steps: list[dict], model: dict) -> dict:
    """facts.shapes of a walk: per step, against ``model`` (hidden, layers, q_heads, kv_heads, head_dim, vocab
    read from the engine's config)."""
    per_step, mismatches = [], []
    for st in steps:
        facts, bad = _step_facts(st, probe.shapes.get(st["step"], {"layers": {}}), probe.lm_head_rows.get(st["step"]),
                                 model)
        per_step.append(facts)
        mismatches += bad
    prefills = [s for s in per_step if s["phase"] == "prefill"]
    return {
        "source": "forward hooks (EngineProbe.named_modules): embedding output, every layer's attention inputs "
                  "q/k/v, final hidden states, LM head; expected shapes from the model's config",
        "model": model,
        "layers_hooked": probe.num_layers,
        "steps": per_step,
        "T_per_step": [s["T"] for s in per_step],
        "tokens_in_shapes_per_step": [s["tokens_in_shapes"] for s in per_step],
        "N_per_step": [s["N"] for s in per_step],
        "every_layer_recorded": bool(per_step) and all(s["layers_recorded"] == model["layers"] for s in per_step),
        "mismatches": mismatches,
        "shapes_match_config": bool(per_step) and not mismatches,
        "lm_head_rows_per_step": [s["lm_head_rows"] for s in per_step],
        "prefill_rows_per_step": [s["lm_head_rows"] for s in prefills],
        "prefill_cu_seqlens_q": [s["cu_seqlens_q"] for s in prefills],
        "lm_head_rows_follow_rule": bool(per_step) and all(s["lm_head_rows_follow_rule"] for s in per_step),
    }


def model_dims(shape) -> dict:
    """The widths the shapes are judged against, from the engine's ``config.shape``."""
    return {"hidden": shape.hidden_size, "layers": shape.num_layers, "q_heads": shape.num_heads,
            "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim, "vocab": shape.vocab_size}
