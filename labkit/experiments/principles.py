"""`labkit principles tokenizer | softmax | attention | memory | slots | timing`: handbook B.1 and B.2.3.

Each figure is computed by the code the lab runs elsewhere, never typed in: the model directory's real
tokenizer, the engine's sampler (engine/sampling/sampler.py), the engine's torch attention backend and its
``Attention`` layer (paged KV store, causal prefill, decode over the block table), the engine's KV-size
formula (``ModelShape.kv_bytes_per_token``, what the runner sizes its pool with), the engine's slot
function (``EngineProbe.slot``) and the runner's slot_mapping, and the latency functions of
``labkit/load/report.py``. The handbook's numbers live in checkpoints/principles.json as assertions.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

from labkit.evidence import write_claimed

#: B.1.1: a fixed Chinese/English text (handbook: "一个 token 一定是一个汉字吗").
TOKENIZER_TEXT = "大模型推理：一个 token 不一定是一个汉字。Hello, nano-vLLM! 缓存让解码更快。"
#: B.1.1: the made-up scores of the teaching softmax.
SOFTMAX_SCORES = (2.0, 1.0, 0.0)
#: B.1.2: Q = K = V = X, three positions of width 2; the future change; the appended 4th position
#: (labs/01's cached check: [0.5, 1] is the vector whose cached last output is the handbook's [0.6304, 0.8374]).
ATTENTION_X = ((1.0, 0.0), (0.0, 1.0), (1.0, 1.0))
ATTENTION_FUTURE = (9.0, -5.0)
ATTENTION_APPEND = (0.5, 1.0)
#: B.1.2 (hand calculation with V != Q/K).
ATTENTION_V2 = ((1.0, 0.0), (0.0, 2.0), (1.0, 2.0))
#: B.1.5: positions per request, requests, block size.
MEMORY_POSITIONS, MEMORY_REQUESTS, MEMORY_BLOCK = 4096, 8, 256
#: B.8.3: the static budget example (GiB): budget, reserve.
BUDGET_GIB, RESERVE_GIB = 16.0, 3.0
#: B.2.3: the teaching block table and positions.
SLOTS_BLOCK_SIZE, SLOTS_TABLE, SLOTS_POSITIONS = 4, (17, 5, 23), (0, 6, 8)
#: B.1.5 / B.8.3: one request sent at 0 s, its four tokens received at these times (s).
TIMING_TOKENS_S = (0.12, 0.16, 0.21, 0.25)

GIB, MIB, KIB = 1 << 30, 1 << 20, 1 << 10


def _write(cid: str, name: str, out: Path | None, kind: str, facts: dict, **envelope) -> dict:
    return write_claimed(cid, out, name, kind=kind, facts=facts, **envelope)


def _model_ref(model: str | None, preset: str | None = None):
    from labkit.assets.identity import model_identity
    from labkit.assets.resolve import default_model, resolve_model

    ref = resolve_model(model, "cpu") if model is not None or preset is None else default_model(preset)
    identity = dict(model_identity(ref.path))
    identity["source"] = ref.source
    return ref, identity


# --------------------------------------------------------------------------- B.1.1 tokenizer


def tokenizer_facts(model_dir: str | Path, text: str = TOKENIZER_TEXT) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok.encode(text, add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    decoded = tok.decode(ids)
    chinese = [c for c in text if "\u4e00" <= c <= "\u9fff"]
    template = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True, enable_thinking=False)
    return {
        "text": text,
        "tokenizer": type(tok).__name__,
        "vocab_size": len(tok),
        "ids": ids,
        "num_tokens": len(ids),
        "token_pieces": pieces,
        "raw_pieces": tok.convert_ids_to_tokens(ids),     # the byte-level BPE strings the vocabulary holds
        "decoded": decoded,
        "roundtrip_equal": decoded == text,
        "chinese_chars": len(chinese),
        # a token is not one Chinese character: pieces that are several characters, or a byte fragment
        "pieces_not_one_char": sum(1 for p in pieces if len(p) != 1),
        "pieces_partial_bytes": sum(1 for p in pieces if "\ufffd" in p),
        "chat_template_text": template,
        "chat_template_ids": len(tok.encode(template, add_special_tokens=False)),
    }


def run_tokenizer(out: Path | None = None, model: str | None = None) -> dict:
    ref, identity = _model_ref(model)
    return _write("principles.tokenizer", "tokenizer.json", out, "static", tokenizer_facts(ref.path), model=identity)


# --------------------------------------------------------------------------- B.1.1 softmax and sampling


def softmax_facts(samples: int = 20000, seed: int = 0) -> dict:
    import torch

    from engine.sampling.params import SamplingParams
    from engine.sampling.processors import RowInputs
    from engine.sampling.sampler import sample_processed, sample_tensor

    scores = torch.tensor([SOFTMAX_SCORES], dtype=torch.float32)
    probs = torch.softmax(scores, dim=-1)[0].tolist()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    # the engine's own probabilities: its log-prob path (a request asking for logprobs=3 at temperature 1)
    n = len(SOFTMAX_SCORES)
    row = RowInputs.of(SamplingParams(temperature=1.0, logprobs=n), [0])
    _, lps = sample_processed(scores.clone(), [1.0], [torch.Generator(device="cpu")], {0: row})
    top_ids, top_p = lps.top_ids[0].tolist(), lps.top_lps[0].exp().tolist()
    engine_probs = [top_p[top_ids.index(i)] if i in top_ids else None for i in range(n)]
    greedy = sample_tensor(scores, [0.0], [gen]).tolist()[0]
    drawn = sample_tensor(scores.expand(samples, -1).contiguous(), [1.0] * samples, [gen] * samples)
    counts = torch.bincount(drawn, minlength=len(SOFTMAX_SCORES)).tolist()
    freqs = [c / samples for c in counts]
    return {
        "scores": list(SOFTMAX_SCORES),
        "probabilities": probs,
        "probabilities_sum": sum(probs),
        "engine_probabilities": engine_probs,
        "engine_logprob_ranking": top_ids,
        "engine_logprobs": "engine.sampling.sampler.sample_processed with logprobs=3 (the log-probs a request gets)",
        "greedy_index": greedy,
        "sampler": "engine.sampling.sampler.sample_tensor (temperature 0: argmax; 1.0: exponential race)",
        "samples": samples,
        "seed": seed,
        "counts": counts,
        "sampled_frequencies": freqs,
        "max_frequency_error": max(abs(f - p) for f, p in zip(freqs, probs)),
    }


def run_softmax(out: Path | None = None, samples: int = 20000, seed: int = 0) -> dict:
    return _write("principles.softmax", "softmax.json", out, "cpu-real-engine", softmax_facts(samples, seed),
                  device="cpu", seed=seed)


# --------------------------------------------------------------------------- B.1.2 causal attention


def attention_layer(head_dim: int, block_size: int, num_blocks: int):
    """The engine's Attention layer (one head) on the torch backend, with its own paged KV cache."""
    import torch

    from engine.attention import create_backend
    from engine.models.qwen3 import Attention

    layer = Attention(1, 1, head_dim, create_backend("torch", block_size))
    layer.k_cache = torch.zeros(num_blocks, block_size, 1, head_dim)
    layer.v_cache = torch.zeros(num_blocks, block_size, 1, head_dim)
    return layer


def prefill_meta(n: int, slots: list[int]):
    import torch

    from engine.attention.metadata import AttentionMetadata

    cu = torch.tensor([0, n], dtype=torch.int32)
    return AttentionMetadata(is_prefill=True, slot_mapping=torch.tensor(slots, dtype=torch.int64),
                             cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=n, max_seqlen_k=n,
                             seqlens_q=[n], seqlens_k=[n])


def decode_meta(n_queries: int, context: int, slots: list[int], table: list[int]):
    import torch

    from engine.attention.metadata import AttentionMetadata

    return AttentionMetadata(is_prefill=False, slot_mapping=torch.tensor(slots, dtype=torch.int64),
                             block_tables=torch.tensor([table] * n_queries, dtype=torch.int32),
                             context_lens=torch.tensor([context] * n_queries, dtype=torch.int32),
                             max_seqlen_q=1, max_seqlen_k=context, seqlens_q=[1] * n_queries,
                             seqlens_k=[context] * n_queries)


def _causal(q_rows, k_rows, v_rows, scale: float | None = None) -> list[list[float]]:
    """Causal prefill of one sequence through the engine's torch backend (nothing cached): [T, D]."""
    import torch

    from engine.attention import create_backend

    q, k, v = (torch.tensor(x, dtype=torch.float64)[:, None, :] for x in (q_rows, k_rows, v_rows))
    n = q.shape[0]
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    empty = torch.zeros(0)
    out = create_backend("torch", 4).forward(q, k, v, empty, empty, prefill_meta(n, [-1] * n), scale)
    return out[:, 0, :].tolist()


def _unmasked(x_rows) -> list[list[float]]:
    """Every position reads every position: the decode path with each query's context = the whole
    sequence (the engine's KV store then its decode attention over the block table)."""
    import torch

    x = torch.tensor(x_rows, dtype=torch.float64)[:, None, :]
    n, d = x.shape[0], x.shape[-1]
    layer = attention_layer(d, block_size=4, num_blocks=(n + 3) // 4)
    layer.k_cache, layer.v_cache = layer.k_cache.double(), layer.v_cache.double()
    layer.backend.store_kv(x, x, layer.k_cache, layer.v_cache, torch.arange(n))
    meta = decode_meta(n, n, [-1] * n, list(range((n + 3) // 4)))
    return layer.backend.forward(x, x, x, layer.k_cache, layer.v_cache, meta, d ** -0.5)[:, 0, :].tolist()


def _max_abs(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def attention_facts() -> dict:
    import torch

    x = [list(r) for r in ATTENTION_X]
    d = len(x[0])
    # the weights: the same scores (Q, K padded with a zero column), V = the identity -> output rows = weights
    pad = [r + [0.0] * len(x) for r in x]
    eye = [[float(i == j) + 0.0 for j in range(d + len(x))] for i in range(len(x))]
    weights = [row[:len(x)] for row in _causal(pad, pad, eye, scale=d ** -0.5)]
    out = _causal(x, x, x)
    future = x[:-1] + [list(ATTENTION_FUTURE)]
    out_future = _causal(future, future, future)
    un, un_future = _unmasked(x), _unmasked(future)
    earlier = len(x) - 1
    # cache equivalence: prefill 3 positions into the engine layer's paged cache, then decode the 4th
    # (one query reading 4 K/V through the block table) against a full causal recompute of all 4
    y = x + [list(ATTENTION_APPEND)]
    full_last = _causal(y, y, y)[-1]
    layer = attention_layer(d, block_size=4, num_blocks=1)
    layer.k_cache, layer.v_cache = layer.k_cache.double(), layer.v_cache.double()
    t = torch.tensor(x, dtype=torch.float64)[:, None, :]
    layer(t, t, t, prefill_meta(len(x), list(range(len(x)))))
    q4 = torch.tensor([list(ATTENTION_APPEND)], dtype=torch.float64)[:, None, :]
    cached_rows = layer(q4, q4, q4, decode_meta(1, len(y), [len(x)], [0]))
    cached_last = cached_rows[0, 0].tolist()
    v2 = [list(r) for r in ATTENTION_V2]
    return {
        "x": x,
        "backend": "engine.attention torch backend (causal varlen prefill; decode over the paged cache)",
        "scale": d ** -0.5,
        "last_row_scores": [sum(a * b for a, b in zip(x[-1], k)) * d ** -0.5 for k in x],
        "weights": weights,
        "last_row_weights": weights[-1],
        "row_sums": [sum(r) for r in weights],
        "row_sum_max_deviation": max(abs(sum(r) - 1.0) for r in weights),
        "upper_triangle_max": max(abs(weights[i][j]) for i in range(len(x)) for j in range(i + 1, len(x))),
        "output": out,
        "last_output": out[-1],
        "future_position": list(ATTENTION_FUTURE),
        "masked_earlier_delta": _max_abs(out[:earlier], out_future[:earlier]),
        "unmasked_earlier_delta": _max_abs(un[:earlier], un_future[:earlier]),
        "future_change_leaves_earlier_unchanged": out[:earlier] == out_future[:earlier],
        "cache": {
            "appended": list(ATTENTION_APPEND),
            "full_last_output": full_last,
            "cached_last_output": cached_last,
            "max_error": max(abs(a - b) for a, b in zip(full_last, cached_last)),
            "query_positions": {"full": len(y), "cached": 1},
            "kv_positions": len(y),
            # what the engine layer did: the K/V slots its paged cache holds after the decode, and the query
            # rows its decode returned
            "kv_slots_written": int((layer.k_cache.abs().sum(dim=(-1, -2)) != 0).sum()),
            "decode_output_rows": len(cached_rows),
        },
        "v_differs": {
            "v": v2,
            "last_row_weights": weights[-1],
            "last_output": _causal(x, x, v2)[-1],
        },
    }


def run_attention(out: Path | None = None) -> dict:
    return _write("principles.attention", "attention.json", out, "cpu-real-engine", attention_facts(), device="cpu")


# --------------------------------------------------------------------------- B.1.5 memory, B.8.3 budget


def _config_of(model: str | None) -> tuple[dict, dict | None]:
    if model is None:
        from labkit.assets.synth import PRESETS

        return dict(PRESETS["qwen3-0.6b"]), None
    ref, identity = _model_ref(model)
    return json.loads((Path(ref.path) / "config.json").read_text()), identity


def _param_count(cfg: dict) -> int:
    """Parameters of a Qwen3 config (embeddings, per-layer projections and norms, final norm, untied head)."""
    from engine.config import ModelShape

    s = ModelShape.from_hf(cfg)
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    layer = s.hidden_size * (q + 2 * kv) + q * s.hidden_size + 3 * s.hidden_size * s.intermediate_size \
        + 2 * s.head_dim + 2 * s.hidden_size
    head = 0 if s.tie_word_embeddings else s.vocab_size * s.hidden_size
    return s.vocab_size * s.hidden_size + s.num_layers * layer + s.hidden_size + head


def _engine_pool_block(shape, dtype) -> dict:
    """One block of the pool the engine allocates for ``shape`` (engine.kv_pool.allocate, on the meta device:
    no memory): its tensor shape [2, layers, 1, block, kv heads, head dim] and bytes."""
    from types import SimpleNamespace

    from engine.kv_pool import allocate

    layers = [SimpleNamespace() for _ in range(shape.num_layers)]
    cfg = SimpleNamespace(shape=shape, kvcache_block_size=MEMORY_BLOCK, kv_cache_dtype="auto")   # the model's dtype
    t = allocate(layers, 1, cfg, dtype, "meta")
    return {"tensor_shape": list(t.shape), "bytes": t.numel() * t.element_size(), "kv_heads_in_pool": t.shape[4]}


def memory_facts(cfg: dict) -> dict:
    import torch

    from engine.config import ModelShape

    s = ModelShape.from_hf(cfg)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    elem = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    per_token = s.kv_bytes_per_token(elem)
    pool = _engine_pool_block(s, getattr(torch, dtype))
    per_request = per_token * MEMORY_POSITIONS
    per_block = per_token * MEMORY_BLOCK
    weights = _param_count(cfg) * elem
    kv_budget = BUDGET_GIB * GIB - weights - RESERVE_GIB * GIB
    pool_blocks = int(kv_budget // per_block)
    blocks_per_request = math.ceil(MEMORY_POSITIONS / MEMORY_BLOCK)
    return {
        "formula": "2 (K and V) x layers x kv_heads x head_dim x bytes per element (engine.config.ModelShape.kv_bytes_per_token)",
        "layers": s.num_layers, "kv_heads": s.num_kv_heads, "q_heads": s.num_heads, "head_dim": s.head_dim,
        "dtype": dtype, "bytes_per_element": elem,
        "kv_bytes_per_token": per_token,
        "kv_kib_per_token": per_token / KIB,
        "positions": MEMORY_POSITIONS,
        "kv_mib_per_request": per_request / MIB,
        "requests": MEMORY_REQUESTS,
        "kv_gib_for_requests": per_request * MEMORY_REQUESTS / GIB,
        "block_size": MEMORY_BLOCK,
        "kv_mib_per_block": per_block / MIB,
        "engine_pool_block": pool,
        "engine_pool_block_matches_formula": pool["bytes"] == per_block,
        "static_budget": {
            "budget_gib": BUDGET_GIB, "reserve_gib": RESERVE_GIB,
            "parameters": _param_count(cfg),
            "weights_gib": round(weights / GIB, 4),
            "kv_gib": round(kv_budget / GIB, 4),
            "pool_blocks": pool_blocks,
            "blocks_per_request": blocks_per_request,
            "requests_that_fit": pool_blocks // blocks_per_request,
        },
    }


def run_memory(out: Path | None = None, model: str | None = None) -> dict:
    cfg, identity = _config_of(model)
    facts = memory_facts(cfg)
    facts["config_source"] = "synth preset qwen3-0.6b (Qwen3-0.6B's config.json shapes)" if model is None else str(model)
    return _write("principles.memory", "memory-budget.json", out, "static", facts, model=identity)


# --------------------------------------------------------------------------- B.2.3 slots


def slots_facts(model: str | None = None, block_size: int = SLOTS_BLOCK_SIZE) -> tuple[dict, object]:
    from engine import SamplingParams
    from engine.sequence import Sequence
    from labkit.experiments.quick_walk import StepRecorder, slot_mismatches
    from labkit.lab_engine import build_engine

    built = build_engine(model, "cpu", "torch", kvcache_block_size=block_size, num_kvcache_blocks=32,
                         max_model_len=64)
    engine = built.engine
    try:
        bs = engine.config.kvcache_block_size
        teach = Sequence(-1, list(range(9)), SamplingParams(), bs)
        teach.block_table = list(SLOTS_TABLE)
        slots = [engine.probe.slot(teach, p) for p in SLOTS_POSITIONS]
        lengths = (255, 256, 257)
        blocks_256 = [Sequence(-1, [0] * n, SamplingParams(), 256).num_blocks for n in lengths]
        # runtime: the runner's slot_mapping of a real walk against the scheduler's block tables
        # two requests at once, so the second one's blocks are not its positions' block numbers
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        seqs = [engine.add_request(list(range(start, start + 9)), params) for start in (300, 400)]
        rec = StepRecorder({s.seq_id: label for s, label in zip(seqs, "AB")})
        engine.events.subscribe(rec)
        while not engine.is_finished():
            engine.step()
        checked, bad = slot_mismatches(rec.steps, bs)
        facts = {
            "formula": "slot = block_table[position // B] * B + position % B (EngineProbe.slot, the runner's slot function)",
            "block_size": bs,
            "teaching": {"block_table": list(SLOTS_TABLE), "positions": list(SLOTS_POSITIONS), "slots": slots},
            "logical_blocks_at_256": {"lengths": list(lengths), "blocks": blocks_256},
            "runtime": {
                "prompt_lens": [9, 9], "max_tokens": 3,
                "block_tables": [[b["block_table"] for b in st["before"]] for st in rec.steps],
                "positions": [st["inputs"]["positions"] for st in rec.steps],
                "slot_mapping": [st["inputs"]["slot_mapping"] for st in rec.steps],
                "slots_checked": checked, "slot_mismatches": bad,
                "slots_follow_formula": checked > 0 and not bad,
                # the most blocks the scheduler gave one sequence (9 + 3 tokens, the last never computed)
                "max_blocks_per_sequence": max((len(b["block_table"]) for st in rec.steps for b in st["before"]),
                                               default=0),
            },
        }
        return facts, built
    finally:
        engine.close()


def run_slots(out: Path | None = None, model: str | None = None, block_size: int = SLOTS_BLOCK_SIZE) -> dict:
    facts, built = slots_facts(model, block_size)
    return _write("principles.slots", "kv-slots.json", out, built.kind, facts, device=built.device,
                  model=built.model, engine=built.describe())


# --------------------------------------------------------------------------- B.1.5 / B.8.3 timing


def timing_facts(token_s: tuple[float, ...] = TIMING_TOKENS_S) -> dict:
    from labkit.load.report import Req, itl_ms, observer_summary, tpot_ms, ttft_ms

    r = Req("example", "client", submitted_ns=0, token_ns=[round(t * 1e9) for t in token_s],
            finished_ns=round(token_s[-1] * 1e9), reason="length")
    summary = observer_summary([r])
    return {
        "functions": "labkit.load.report ttft_ms / itl_ms / tpot_ms / observer_summary (what `labkit report` uses)",
        "sent_s": 0.0, "tokens_s": list(token_s),
        "ttft_ms": ttft_ms(r), "itl_ms": itl_ms(r), "tpot_ms": tpot_ms(r),
        "tpot_definition": "(last token - first token) / (tokens - 1)",
        "output_tokens": summary["output_tokens"],
        "window_s": summary["window"]["seconds"],
        "throughput_tok_s": summary["throughput_tok_s"],
        "throughput_definition": "output tokens / the window from the first submission to the last token",
    }


def run_timing(out: Path | None = None) -> dict:
    return _write("principles.timing", "timing-example.json", out, "static", timing_facts())
