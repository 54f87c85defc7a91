"""`labkit principles shapes --tp N`: how Qwen3's weights split across tensor-parallel ranks, measured.

Nothing here restates the config. The model's real safetensors are loaded through the engine's own
tensor-parallel layers (QKVParallelLinear, MergedColumnParallelLinear, RowParallelLinear, built for
each rank with ``ParallelContext(rank=r, world_size=N)`` and no process group) and their weight loaders,
the way the engine's loader feeds them (its ``packed_modules_mapping`` picks the shard ids). Then:

- each rank's parameter shapes are read off the loaded layers;
- each rank's packed weights are split the way the model's forward consumes them (qkv into
  [q, k, v] by the rank's head counts, gate_up into halves) and the ranks' pieces, concatenated along
  the split dimension (rows for column-parallel, columns for row-parallel), are compared with the
  checkpoint tensors: every layer's q/k/v, gate/up, o_proj and down_proj must come back exactly
  (max abs difference 0);
- the rows of the TP=1 packed qkv weight that each rank holds are found by matching the rank's q/k/v
  pieces against a TP=1 layer loaded from the same tensors;
- the collectives per forward are counted by running the engine's whole model, built for rank 0 of N on
  the meta device, with a ParallelContext that counts its all-reduce and all-gather calls.

No CUDA and no processes are needed. The evidence kind is ``static``: no engine step runs.
"""
from __future__ import annotations

import json
from pathlib import Path

from labkit.errors import UserError

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _shape_of(cfg: dict):
    from engine.config import ModelShape

    return ModelShape.from_hf(cfg)


def _rank_layers(cfg: dict, rank: int, tp: int) -> dict:
    """One decoder layer's parallel linears, built as the engine builds them for ``rank`` of ``tp``."""
    from engine.distributed import ParallelContext
    from engine.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear

    s = _shape_of(cfg)
    ctx = ParallelContext(rank=rank, world_size=tp)
    bias = bool(cfg.get("attention_bias", False))
    return {
        "qkv_proj": QKVParallelLinear(s.hidden_size, s.head_dim, s.num_heads, s.num_kv_heads, bias, ctx),
        "o_proj": RowParallelLinear(s.num_heads * s.head_dim, s.hidden_size, bias, ctx),
        "gate_up_proj": MergedColumnParallelLinear(s.hidden_size, [s.intermediate_size] * 2, False, ctx),
        "down_proj": RowParallelLinear(s.intermediate_size, s.hidden_size, False, ctx),
    }


def _load(layers: dict, tensors: dict) -> None:
    """Feed checkpoint tensors (short names: q_proj, ...) through the layers' weight loaders, mapping names
    and shard ids with the engine model's packed_modules_mapping, as engine.loader does."""
    from engine.models.qwen3 import Qwen3ForCausalLM

    mapping = Qwen3ForCausalLM.packed_modules_mapping
    for name, tensor in tensors.items():
        target, shard = mapping.get(name, (name, None))
        param = layers[target].weight
        if shard is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard)


def _pieces(layers: dict, cfg: dict, tp: int) -> dict:
    """A rank's loaded weights cut the way the model's forward uses them: qkv by the rank's heads
    (Qwen3Attention.forward), gate_up in halves (SiluAndMul); o/down whole."""
    s = _shape_of(cfg)
    q, kv = s.num_heads // tp * s.head_dim, s.num_kv_heads // tp * s.head_dim
    qw, kw, vw = layers["qkv_proj"].weight.data.split([q, kv, kv], dim=0)
    gate, up = layers["gate_up_proj"].weight.data.chunk(2, dim=0)
    return {"q_proj": qw, "k_proj": kw, "v_proj": vw, "gate_proj": gate, "up_proj": up,
            "o_proj": layers["o_proj"].weight.data, "down_proj": layers["down_proj"].weight.data}


_SPLIT_DIM = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "gate_proj": 0, "up_proj": 0, "o_proj": 1, "down_proj": 1}


def _find_rows(full, part, step: int) -> list[int] | None:
    """[start, end) of the rows of ``full`` equal to ``part`` (searched at multiples of ``step``)."""
    import torch

    n = part.shape[0]
    for start in range(0, full.shape[0] - n + 1, step):
        if torch.equal(full[start:start + n], part):
            return [start, start + n]
    return None


def count_collectives(cfg: dict, tp: int) -> dict:
    """All-reduce and all-gather calls of one forward (3 tokens, prefill) plus the logits of the engine's
    model built for rank 0 of ``tp`` on the meta device (shapes only, no memory, no process group)."""
    import torch

    from engine.attention import AttentionMetadata, create_backend
    from engine.distributed import ParallelContext
    from engine.models.qwen3 import Qwen3ForCausalLM

    class Counting(ParallelContext):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.calls: dict[str, int] = {"all_reduce": 0, "all_gather": 0}

        def all_reduce(self, x):
            self.calls["all_reduce"] += 1
            return x

        def all_gather_last_dim(self, x):
            self.calls["all_gather"] += 1
            return torch.cat([x] * self.world_size, dim=-1)

    ctx = Counting(rank=0, world_size=tp)
    n = 3
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg, create_backend("torch", 256), ctx)
        meta = AttentionMetadata(is_prefill=True, slot_mapping=torch.full((n,), -1),
                                 cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
                                 cu_seqlens_k=torch.tensor([0, n], dtype=torch.int32),
                                 max_seqlen_q=n, max_seqlen_k=n, seqlens_q=[n], seqlens_k=[n])
        with torch.no_grad():
            logits = model.compute_logits(model(torch.zeros(n, dtype=torch.long), torch.arange(n), meta))
    return {"tokens": n, "all_reduce": ctx.calls["all_reduce"], "all_gather": ctx.calls["all_gather"],
            "logits_shape": list(logits.shape)}


def _rank_facts(r: dict, pc: dict, packed, head_dim: int) -> dict:
    """One rank's layer-0 shapes and where its q/k/v pieces sit in the TP=1 packed qkv weight."""
    L = r["layers"]
    return {
        "rank": r["rank"],
        # the heads each rank's engine layer holds (QKVParallelLinear computes them from its world size)
        "q_heads": L["qkv_proj"].num_heads,
        "kv_heads": L["qkv_proj"].num_kv_heads,
        "qkv_proj_weight": list(L["qkv_proj"].weight.shape),
        "qkv_proj_out": L["qkv_proj"].weight.shape[0],
        "gate_up_proj_weight": list(L["gate_up_proj"].weight.shape),
        "gate_up_proj_out": L["gate_up_proj"].weight.shape[0],
        "o_proj_weight": list(L["o_proj"].weight.shape),
        "o_proj_in": L["o_proj"].weight.shape[1],
        "down_proj_weight": list(L["down_proj"].weight.shape),
        "down_proj_in": L["down_proj"].weight.shape[1],
        "piece_shapes": {n: list(t.shape) for n, t in pc.items()},
        "rows_of_tp1_packed_qkv": {n[0]: _find_rows(packed, pc[n], head_dim) if n in pc else None
                                   for n in ("q_proj", "k_proj", "v_proj")},
    }


def _qkv_rows_tp1(s, layer, full: dict) -> dict:
    """Handbook B.3 step 4: the rows of the TP=1 packed qkv weight that the checkpoint's q_proj, k_proj and
    v_proj were written to, three ways: from the config (q = heads x head_dim, kv = kv_heads x head_dim,
    packed q | k | v), from the engine's loader (``QKVParallelLinear.shard_range``) and measured: each
    checkpoint tensor found, by its values, in layer 0's loaded packed weight."""
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    packed = layer.weight.data
    measured = {n[0]: _find_rows(packed, full[n], s.head_dim) for n in ("q_proj", "k_proj", "v_proj")}
    config = {"q": [0, q], "k": [q, q + kv], "v": [q + kv, q + 2 * kv]}
    loader = {n: [off, off + size] for n in "qkv" for off, size in [layer.shard_range(n)]}
    return {
        "widths": {"q": q, "k": kv, "v": kv, "total": q + 2 * kv},
        "packed_rows": int(layer.weight.shape[0]),
        "from_config": config,
        "from_loader": loader,
        "measured": measured,
        "loader_matches_config": loader == config,
        "measured_matches_config": measured == config,
    }


def tp_shapes(model_dir: str | Path, tp: int) -> dict:
    """Load every decoder layer's linear weights of ``model_dir`` into ``tp`` ranks and measure the split."""
    import torch
    from safetensors import safe_open

    model_dir = Path(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    s = _shape_of(cfg)
    if s.num_heads % tp or s.num_kv_heads % tp:
        raise UserError(f"--tp {tp} must divide {s.num_heads} q heads and {s.num_kv_heads} kv heads")
    files = sorted(model_dir.glob("*.safetensors"))
    handles = [safe_open(str(f), "pt", "cpu") for f in files]
    where = {name: h for h in handles for name in h.keys()}

    def tensor(name: str):
        if name not in where:
            raise UserError(f"{model_dir}: checkpoint has no tensor {name}")
        return where[name].get_tensor(name)

    worst = {name: 0.0 for name in _ATTN + _MLP}
    exact_layers = {name: 0 for name in _ATTN + _MLP}
    ranks: list[dict] = []
    errors: list[str] = []
    for layer in range(s.num_layers):
        p = f"model.layers.{layer}."
        full = {n: tensor(p + ("self_attn." if n in _ATTN else "mlp.") + n + ".weight") for n in _ATTN + _MLP}
        pieces = []
        for rank in range(tp):
            layers = _rank_layers(cfg, rank, tp)
            try:
                _load(layers, full)
                pieces.append(_pieces(layers, cfg, tp))
            except Exception as e:           # a shard that does not fit its parameter: recorded, judged
                errors.append(f"layer {layer} rank {rank}: {type(e).__name__}: {e}")
                pieces.append({})
            if layer == 0:
                ranks.append({"rank": rank, "layers": layers})
        for n in full:
            parts = [pc.get(n) for pc in pieces]
            joined = None if any(x is None for x in parts) else torch.cat(parts, dim=_SPLIT_DIM[n])
            if joined is None or joined.shape != full[n].shape:
                diff = float("inf")
            else:
                diff = float((joined.float() - full[n].float()).abs().max())
            worst[n] = max(worst[n], diff)
            exact_layers[n] += diff == 0.0
        if layer == 0:
            layer0_pieces, layer0_full = pieces, full
    # where each rank's q/k/v rows sit in the TP=1 packed qkv weight, found by matching real rows
    tp1 = _rank_layers(cfg, 0, 1)
    _load(tp1, layer0_full)
    packed = tp1["qkv_proj"].weight.data
    out_ranks = [_rank_facts(r, pc, packed, s.head_dim) for r, pc in zip(ranks, layer0_pieces)]
    return {
        "tp": tp,
        "model_dir": str(model_dir),
        "qkv_rows_tp1": _qkv_rows_tp1(s, tp1["qkv_proj"], layer0_full),
        "model": {"hidden": s.hidden_size, "q_heads": s.num_heads, "kv_heads": s.num_kv_heads,
                  "head_dim": s.head_dim, "intermediate": s.intermediate_size, "vocab": s.vocab_size,
                  "layers": s.num_layers},
        "method": "checkpoint tensors loaded through each rank's engine layers (weight_loader), cut as the "
                  "forward cuts them, concatenated along the split dimension and compared with the tensor",
        "layers_checked": s.num_layers,
        "reassembly_max_abs_diff": worst,
        "reassembly_worst_max_abs_diff": max(worst.values()),
        "load_errors": errors,
        "reassembly_exact_layers": exact_layers,
        "split_dims": {n: ("rows (column-parallel)" if d == 0 else "columns (row-parallel)")
                       for n, d in _SPLIT_DIM.items()},
        "collectives_per_forward": count_collectives(cfg, tp),
        "ranks": out_ranks,
    }


def run_shapes(tp: int, model: str | None, out: Path | None) -> dict:
    """``model`` or, by default, the embedded synthetic qwen3-0.6b (made on first use): the checkpoint's
    numbers are Qwen3-0.6B's."""
    from labkit.assets.identity import model_identity
    from labkit.assets.resolve import default_model, resolve_model
    from labkit.evidence import write_evidence
    from labkit.paths import default_out

    ref = resolve_model(model, "cpu") if model is not None else default_model("qwen3-0.6b")
    facts = tp_shapes(ref.path, tp)
    identity = dict(model_identity(ref.path))
    identity["source"] = ref.source
    return write_evidence(out or default_out(f"tensor-parallel-shapes-tp{tp}.json"),
                          checkpoint={1: "tp.shapes-tp1", 2: "tp.shapes"}.get(tp), kind="static", facts=facts, model=identity)
