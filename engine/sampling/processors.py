"""Per-request logits processors, vectorized over the rows that need them, on the logits' device.

Only rows whose SamplingParams ask for something beyond temperature come here (see
SamplingParams.needs_processing); a batch with none of them never touches this module.

Order, as vLLM's v1 sampler: min_tokens mask, allowed_token_ids mask and logit_bias, penalties (repetition over prompt and
output tokens, frequency / presence over output tokens), then, for sampled rows, temperature, min_p,
top_k, top_p. Greedy rows (temperature 0) stop after the penalties: their argmax is taken there.
Removed tokens are -inf, so softmax gives them probability 0 and a Gumbel/exponential draw never picks them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling.params import SamplingParams


def to_device(data, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list as a tensor on ``device`` without waiting: on CUDA through pinned memory and an async
    copy. (torch.tensor(data, device=cuda) copies from pageable memory and then synchronizes the stream,
    i.e. waits for every step in flight: it would undo the overlapped decode.)"""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(data, dtype=dtype, device=device)
    return torch.tensor(data, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass
class RowInputs:
    """What the processors need of one row: its settings and its token history (the sequence's own
    list, not copied: token_ids[:num_prompt] is the prompt, the rest the output so far)."""
    params: SamplingParams
    token_ids: list[int]
    num_prompt: int
    eos_ids: tuple[int, ...] = ()
    key: int | None = None            # the sequence's id: its counts are kept in a TokenHistory

    @classmethod
    def of(cls, params: SamplingParams, prompt_ids, output_ids=(), eos_ids=()) -> "RowInputs":
        return cls(params, [*prompt_ids, *output_ids], len(prompt_ids), tuple(eos_ids))

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def num_outputs(self) -> int:
        return len(self.token_ids) - self.num_prompt


class TokenHistory:
    """Penalty rows' token counts kept on the device across steps, so that a row costs one scatter of its
    new tokens per step instead of rebuilding its whole history: one slot per sequence in two buffers,
    prompt tokens seen [slots, V] bool and output token counts [slots, V] int32, grown 64 slots at a time
    (about 39 MB per 64 slots at Qwen3's vocabulary). forget() frees a finished sequence's slot."""

    GROW = 64

    def __init__(self, vocab: int, device):
        self.vocab, self.device = vocab, device
        self.slots: dict[int, tuple[int, int]] = {}      # key -> (slot, outputs counted)
        self.free: list[int] = []
        self.seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)

    def _grow(self) -> None:
        n = self.seen.shape[0]
        self.seen = torch.cat([self.seen, torch.zeros(self.GROW, self.vocab, dtype=torch.bool, device=self.device)])
        self.counts = torch.cat([self.counts, torch.zeros(self.GROW, self.vocab, dtype=torch.int32, device=self.device)])
        self.free.extend(range(n + self.GROW - 1, n - 1, -1))

    def gather(self, rows: list[RowInputs]) -> tuple[torch.Tensor, torch.Tensor]:
        """(prompt tokens seen [R, V] bool, output counts [R, V] int32) of the rows, brought up to date."""
        slots, p_slot, p_tok, o_slot, o_tok = [], [], [], [], []
        for row in rows:
            slot, done = self.slots.get(row.key, (None, 0))
            if slot is None or done > row.num_outputs:
                if slot is None:
                    if not self.free:
                        self._grow()
                    slot = self.free.pop()
                self.seen[slot].zero_()
                self.counts[slot].zero_()
                p_slot += [slot] * row.num_prompt
                p_tok += row.prompt_ids
                done = 0
            new = row.token_ids[row.num_prompt + done:]
            o_slot += [slot] * len(new)
            o_tok += new
            self.slots[row.key] = (slot, row.num_outputs)
            slots.append(slot)
        dev = self.device
        if p_slot:
            self.seen[to_device(p_slot, dev), to_device(p_tok, dev)] = True
        if o_slot:
            self.counts.index_put_((to_device(o_slot, dev), to_device(o_tok, dev)),
                                   torch.ones(len(o_slot), dtype=torch.int32, device=dev), accumulate=True)
        idx = to_device(slots, dev)
        return self.seen.index_select(0, idx), self.counts.index_select(0, idx)

    def forget(self, key: int) -> None:
        entry = self.slots.pop(key, None)
        if entry is not None:
            self.free.append(entry[0])


def _padded(lists: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(1, max(len(x) for x in lists))
    return to_device([x + [pad] * (width - len(x)) for x in lists], device, torch.int64)


def token_counts(lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[R, V] int32: how often each token occurs in each row's list (the pad id `vocab` is dropped)."""
    ids = _padded(lists, vocab, device)
    counts = torch.zeros(len(lists), vocab + 1, dtype=torch.int32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    return counts[:, :vocab]


def apply_min_tokens(logits: torch.Tensor, rows: list[RowInputs]) -> None:
    """Rows short of min_tokens: EOS (unless ignore_eos) and stop_token_ids can not be drawn yet."""
    r_idx, t_idx = [], []
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        sp = row.params
        if row.num_outputs < sp.min_tokens:
            stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(row.eos_ids))
            for t in stops:
                if t < vocab:
                    r_idx.append(i)
                    t_idx.append(t)
    if r_idx:
        logits[to_device(r_idx, logits.device), to_device(t_idx, logits.device)] = float("-inf")


def _id_tensors(params: SamplingParams, name: str, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A request's logit_bias (ids, biases) or allowed_token_ids (ids, None) as device tensors, made once per
    request and device (kept on the params object) instead of walked in Python every step."""
    key = (name, str(device))
    cached = params._device_cache.get(key)
    if cached is None:
        if name == "logit_bias":
            bias = params.logit_bias or {}
            cached = (to_device(list(bias), device, torch.int64), to_device(list(bias.values()), device, torch.float32))
        else:
            cached = (to_device(params.allowed_token_ids or [], device, torch.int64), None)
        params._device_cache[key] = cached
    return cached


def _row_scatter(rows: list[RowInputs], name: str, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(row index, token id, value) of every entry of the rows' ``name``, concatenated on the device: one
    torch.cat of per-request tensors, no Python loop over entries."""
    r_idx, t_idx, vals = [], [], []
    for i, row in enumerate(rows):
        if getattr(row.params, name) is None:
            continue
        ids, v = _id_tensors(row.params, name, device)
        r_idx.append(torch.full((ids.shape[0],), i, dtype=torch.int64, device=device))
        t_idx.append(ids)
        vals.append(v)
    if not r_idx:
        return None, None, None
    cat = torch.cat
    return cat(r_idx), cat(t_idx), (cat(vals) if vals[0] is not None else None)


def apply_logit_bias(logits: torch.Tensor, rows: list[RowInputs]) -> None:
    """Each row's logit_bias added to its logits: one index_put (accumulate) for the whole batch."""
    r_idx, t_idx, bias = _row_scatter(rows, "logit_bias", logits.device)
    if r_idx is not None:
        logits.index_put_((r_idx, t_idx), bias.to(logits.dtype), accumulate=True)


def apply_allowed_token_ids(logits: torch.Tensor, rows: list[RowInputs]) -> None:
    """Rows with allowed_token_ids: every other token -inf (vLLM's mask), one scatter for the batch."""
    which = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if not which:
        return
    r_idx, t_idx, _ = _row_scatter(rows, "allowed_token_ids", logits.device)
    keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    keep[r_idx, t_idx] = True
    masked = to_device(which, logits.device)
    keep_rows = keep.index_select(0, masked)
    logits.index_copy_(0, masked, logits.index_select(0, masked).masked_fill(~keep_rows, float("-inf")))


def apply_penalties(logits: torch.Tensor, rows: list[RowInputs], history: TokenHistory | None = None) -> None:
    """repetition: a seen token's logit is divided by the penalty if positive, multiplied if not (seen =
    in the prompt or the output); frequency: minus penalty x output count; presence: minus penalty if
    the token occurs in the output. history: counts kept across steps (else built from the lists)."""
    which = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not which:
        return
    dev, vocab = logits.device, logits.shape[1]
    sub = [rows[i] for i in which]
    idx = to_device(which, dev)
    x = logits.index_select(0, idx)
    if history is not None:
        in_prompt, out_counts = history.gather(sub)
    else:
        in_prompt, out_counts = None, token_counts([r.output_ids for r in sub], vocab, dev)
    rep = to_device([r.params.repetition_penalty for r in sub], dev, x.dtype).unsqueeze(1)
    if any(r.params.repetition_penalty != 1 for r in sub):
        if in_prompt is None:
            in_prompt = token_counts([r.prompt_ids for r in sub], vocab, dev) > 0
        seen = in_prompt | (out_counts > 0)
        penalized = torch.where(x > 0, x / rep, x * rep)
        x = torch.where(seen, penalized, x)
    freq = to_device([r.params.frequency_penalty for r in sub], dev, x.dtype).unsqueeze(1)
    pres = to_device([r.params.presence_penalty for r in sub], dev, x.dtype).unsqueeze(1)
    x = x - freq * out_counts.to(x.dtype) - pres * (out_counts > 0).to(x.dtype)
    logits.index_copy_(0, idx, x)


def apply_temperature(logits: torch.Tensor, temperatures: list[float]) -> None:
    """Sampled rows divided by their temperature; temperature 0 rows are left as they are."""
    t = to_device([t if t > 0 else 1.0 for t in temperatures], logits.device, logits.dtype)
    logits.div_(t.unsqueeze(1))


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> None:
    """Tokens whose probability is below min_p x the top token's probability are removed."""
    if not any(p > 0 for p in min_p):
        return
    mp = to_device(min_p, logits.device, logits.dtype).unsqueeze(1)
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(dim=-1, keepdim=True).values * mp
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """One ascending sort of the rows: top_k keeps the tokens at least as large as the k-th largest
    (ties with it stay); top_p removes the smallest tokens whose cumulative probability stays <= 1 - p,
    always keeping the top one. top_k <= 0 and top_p == 1 are off for their row."""
    use_k = any(k > 0 for k in top_k)
    use_p = any(p < 1 for p in top_p)
    if not use_k and not use_p:
        return logits
    vocab = logits.shape[1]
    if all(k > 0 for k in top_k) and max(top_k) <= min(TOP_K_FIRST_MAX, vocab - 1):
        return _top_k_first(logits, top_k, top_p)
    srt, order = logits.sort(dim=-1, descending=False)
    if use_k:
        k = to_device([min(k, vocab) if k > 0 else vocab for k in top_k], logits.device)
        kth = srt.gather(1, (vocab - k).unsqueeze(1))
        srt = srt.masked_fill(srt < kth, float("-inf"))
    if use_p:
        p = to_device(top_p, logits.device, srt.dtype).unsqueeze(1)
        cum = torch.softmax(srt, dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - p
        drop[:, -1] = False
        srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(srt).scatter_(1, order, srt)


#: When every row has a top_k up to this, the rows are cut with one top-k selection instead of a sort of
#: the whole vocabulary (the sampling-heavy case: top_k 50 with top_p on every request).
TOP_K_FIRST_MAX = 1024


def _top_k_first(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """apply_top_k_top_p when every row has a top_k: only the k largest of each row are sorted (topk), top_p
    is taken within them (its softmax over the row's top_k values), and the row is cut at the smallest value
    kept. Tokens equal to that value all stay (the full sort keeps an arbitrary part of such ties)."""
    kmax = max(top_k)
    vals = logits.topk(kmax, dim=-1).values                                   # descending
    last = to_device([k - 1 for k in top_k], logits.device).unsqueeze(1)
    if any(p < 1 for p in top_p):
        ranks = torch.arange(kmax, device=logits.device).unsqueeze(0)
        probs = torch.softmax(vals.masked_fill(ranks > last, float("-inf")), dim=-1)
        larger = probs.cumsum(dim=-1) - probs                                  # mass of the tokens above each
        p = to_device(top_p, logits.device, probs.dtype).unsqueeze(1)
        kept = ((larger < p) & (ranks <= last)).sum(dim=1, keepdim=True)       # the top one always stays
        last = torch.minimum(last, kept - 1)
    return logits.masked_fill(logits < vals.gather(1, last), float("-inf"))


def process(logits: torch.Tensor, rows: list[RowInputs], history: TokenHistory | None = None) -> torch.Tensor:
    """The rows' logits (float32 copy) with every processor applied: what the draw reads. Sampled rows
    come out divided by their temperature (draw them at temperature 1); greedy rows without it."""
    x = logits.float().clone()
    apply_min_tokens(x, rows)
    apply_allowed_token_ids(x, rows)
    apply_logit_bias(x, rows)
    apply_penalties(x, rows, history)
    temps = [r.params.temperature for r in rows]
    if all(t == 0 for t in temps):
        return x
    apply_temperature(x, temps)
    sampled = [t > 0 for t in temps]
    apply_min_p(x, [r.params.min_p if s else 0.0 for r, s in zip(rows, sampled)])
    return apply_top_k_top_p(x, [r.params.top_k if s else -1 for r, s in zip(rows, sampled)],
                             [r.params.top_p if s else 1.0 for r, s in zip(rows, sampled)])
