"""Quick-walk case ``lifecycle`` (handbook B.2.1, B.3, 5.2): two prompts of 64 and 96 tokens, outputs 2
and 3, followed through the real engine, with layer 0's tensor shapes (``--shapes``).

The runner metadata comes from the engine's step events (scheduled / inputs / postprocessed). The shapes
come from read-only forward hooks on the model's modules (``EngineProbe.named_modules``): layer 0's
qkv_proj, its attention (q, k, v as the backend receives them), o_proj, gate_up_proj, down_proj, the
embedding and the LM head. The rows the LM head reads are found by matching its input rows against the
model's final hidden states (measured, not computed from cu_seqlens), then compared with
``cu_seqlens_q[1:] - 1``.

The handbook's shapes are Qwen3-0.6B's. Without ``--model`` the walk uses a synthetic model of that
shape: on CUDA the full qwen3-0.6b preset, on a CPU ``qwen3-0.6b-2l`` (the same widths and vocabulary
with 2 of the 28 layers: layer 0's shapes and the runner metadata do not depend on the layer count),
and the evidence says which.
"""
from __future__ import annotations

from pathlib import Path

from engine import SamplingParams
from labkit.evidence import write_claimed
from labkit.experiments.quick_walk import StepRecorder, derive, step_blocks
from labkit.experiments.walk_shapes import row_index
from labkit.lab_engine import build_engine, detect_device, install_env_trace, synthetic_note

PROMPT_LENS = (64, 96)
MAX_TOKENS = (2, 3)
LABELS = ("R1", "R2")
LAYER0 = {
    "embed": "model.embed_tokens",
    "qkv_proj": "model.layers.0.self_attn.qkv_proj",
    "attn": "model.layers.0.self_attn.attn",
    "o_proj": "model.layers.0.self_attn.o_proj",
    "gate_up_proj": "model.layers.0.mlp.gate_up_proj",
    "down_proj": "model.layers.0.mlp.down_proj",
    "final_hidden": "model",
    "logits": "lm_head",
}


def default_lifecycle_model(device: str) -> tuple[str, str]:
    """(model path, why) for a walk without --model: Qwen3-0.6B's shape, 2 layers on a CPU."""
    from labkit.assets.resolve import default_model

    preset = "qwen3-0.6b" if device.startswith("cuda") else "qwen3-0.6b-2l"
    why = ("synthetic qwen3-0.6b (the handbook's shapes)" if preset == "qwen3-0.6b" else
           "synthetic qwen3-0.6b-2l: Qwen3-0.6B's widths and vocabulary with 2 of its 28 layers (CPU: 28 are slow); "
           "layer 0's shapes and the runner metadata do not depend on the layer count")
    return str(default_model(preset).path), why


class ShapeProbe:
    """Forward hooks on layer 0's modules; shapes per engine step, and the rows the LM head read."""

    def __init__(self, engine, recorder: StepRecorder):
        self.recorder = recorder
        self.shapes: dict[int, dict] = {}
        self.last_rows: dict[int, list[int]] = {}
        self._hidden = None
        modules = dict(engine.probe.named_modules())
        missing = [n for n in LAYER0.values() if n not in modules]
        if missing:
            raise RuntimeError(f"the model has no module {missing[0]!r}")
        self.handles = [modules[name].register_forward_hook(self._hook(key)) for key, name in LAYER0.items()]

    def _step(self) -> int:
        return len(self.recorder.steps)

    def _hook(self, key: str):
        def hook(module, args, output):
            shapes = self.shapes.setdefault(self._step(), {})
            if key == "attn":
                q, k, v = args[:3]
                shapes.update(q=list(q.shape), k=list(k.shape), v=list(v.shape))
                return
            out = output[0] if isinstance(output, tuple) else output
            shapes[key] = list(out.shape)
            if key == "final_hidden":
                self._hidden = out.detach()
            elif key == "logits" and self._hidden is not None:
                rows = args[0].detach()
                self.last_rows[self._step()] = [row_index(self._hidden, r) for r in rows]
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def run_lifecycle(out: Path | None = None, model: str | None = None, device: str = "auto", attention: str = "auto",
                  budget: int = 512, max_num_seqs: int | None = None, block_size: int = 256,
                  shapes: bool = False, trace: bool = False, shuffle_blocks: int | None = None,
                  debug: bool = False) -> dict:
    device = detect_device(device)
    model_note = None
    if model is None:
        model, model_note = default_lifecycle_model(device)
    built = build_engine(model, device, attention, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                         kvcache_block_size=block_size, shuffle_blocks=shuffle_blocks)
    engine = built.engine
    install_env_trace(engine)
    if debug:                      # --debug: pdb after the engine is built, before R1 and R2 are added
        from labkit.experiments.walk_debug import debug_prompt

        debug_prompt(engine)
    prompts = [list(range(5000, 5000 + PROMPT_LENS[0])), list(range(7000, 7000 + PROMPT_LENS[1]))]
    seqs = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True))
            for p, m in zip(prompts, MAX_TOKENS)]
    recorder = StepRecorder({s.seq_id: n for s, n in zip(seqs, LABELS)})
    engine.events.subscribe(recorder)
    probe = ShapeProbe(engine, recorder) if shapes else None
    steps = recorder.run(engine, bool(built.describe().get("fused_ops")), probe)
    shape = engine.config.shape
    first = steps[0]
    decode = next((st for st in steps if st["phase"] == "decode"), None)
    facts = {
        "case": "lifecycle", "title": "two prompts of 64 and 96 tokens, outputs 2 and 3 (B.2.1, B.3)",
        "options": {"budget": budget, "max_num_seqs": engine.config.max_num_seqs, "block_size": block_size,
                    "max_model_len": engine.config.max_model_len, "shuffle_blocks": engine.config.shuffle_blocks},
        "model_shape": {"hidden": shape.hidden_size, "layers": shape.num_layers, "q_heads": shape.num_heads,
                        "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
                        "intermediate": shape.intermediate_size, "vocab": shape.vocab_size},
        "model_note": model_note,
        "requests": [{"label": n, "prompt_len": len(p), "max_tokens": m} for n, p, m in zip(LABELS, prompts, MAX_TOKENS)],
        "phases": [st["phase"] for st in steps],
        "num_steps": len(steps),
        "prefill": {"input_shape": first["inputs"]["input_shape"], "cu_seqlens_q": first["inputs"]["cu_seqlens_q"],
                    "cu_seqlens_k": first["inputs"]["cu_seqlens_k"], "has_block_tables": first["inputs"]["has_block_tables"],
                    "after_total": [s["total"] for s in first["after"]["seqs"]],
                    "after_cached": [s["cached"] for s in first["after"]["seqs"]]},
        "first_decode": None if decode is None else {
            "input_shape": decode["inputs"]["input_shape"], "positions": decode["inputs"]["positions"],
            "context_lens": decode["inputs"]["context_lens"]},
        "finished_order": [lab for st in steps for lab in st["after"]["finished"]],
        "finished_at_step": {lab: st["step"] for st in steps for lab in st["after"]["finished"]},
        "output_counts": [s.num_completion_tokens for s in seqs],
        "final": [{"label": n, "cached": s.num_cached_tokens, "block_table": list(s.block_table),
                   "status": s.status.name} for n, s in zip(LABELS, seqs)],
        "derived": derive(steps, list(LABELS), block_size),
        "step_digest": [{"step": st["step"], "phase": st["phase"],
                         "before": [[s["label"], s["total"], s["cached"], s["scheduled"], len(s["block_table"])] for s in st["before"]],
                         "input_shape": st["inputs"]["input_shape"], "positions": st["inputs"]["positions"][:4],
                         "cu_seqlens_q": st["inputs"]["cu_seqlens_q"], "cu_seqlens_k": st["inputs"]["cu_seqlens_k"],
                         "context_lens": st["inputs"]["context_lens"],
                         "after": [[s["label"], s["total"], s["cached"], len(s["block_table"])] for s in st["after"]["seqs"]],
                         "finished": st["after"]["finished"], **step_blocks(st)} for st in steps],
        "note": synthetic_note(built.model),
    }
    if probe is not None:
        cu = first["inputs"]["cu_seqlens_q"]
        facts["shapes"] = {
            "source": "forward hooks on layer 0 (EngineProbe.named_modules); q/k/v as the attention backend receives them",
            "prefill": probe.shapes.get(1, {}),
            "first_decode": probe.shapes.get(decode["step"], {}) if decode else {},
            "last_rows": {str(k): v for k, v in sorted(probe.last_rows.items())},
            "prefill_last_rows": probe.last_rows.get(1),
            "cu_seqlens_q_minus_1": [c - 1 for c in cu[1:]],
            "last_rows_are_cu_seqlens_q_minus_1": probe.last_rows.get(1) == [c - 1 for c in cu[1:]],
        }
    facts["steps"] = steps          # always (its checkpoint's command has no --trace): the pictures read them
    default_opts = budget == 512 and block_size == 256 and max_num_seqs is None and shuffle_blocks is None
    record = write_claimed("principles.lifecycle" if default_opts else None, out, "lifecycle.json", unclaimed_name="quick-walk-lifecycle-custom.json",
                           kind=built.kind, facts=facts, device=built.device, model=built.model,
                           seed=engine.config.seed, engine=built.describe())
    engine.close()
    return record
