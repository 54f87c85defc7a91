"""Greedy at temperature 0, seeded temperature sampling otherwise, on the logits' device.

CUDA: one fused Triton pass (engine/layers/sample_kernel.py, Gumbel-max keyed by per-row seeds drawn
from each row's generator). CPU: the exponential race in torch. Both draw exactly from softmax(logits / T).

Rows whose requests ask for more (top_p/top_k/min_p, penalties, logit_bias, min_tokens, logprobs) go
through :func:`sample_processed`: their logits pass the processors of engine/layers/logits_process.py
and are then drawn by the same code at temperature 1 (the processors applied the temperature), each
with its own generator; the other rows of the batch take the plain path unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.layers.logits_process import RowInputs, TokenHistory, process, to_device

try:
    from engine.layers.sample_kernel import gumbel_argmax
except ImportError:            # no triton (CPU machines)
    gumbel_argmax = None


def _rows_by_generator(generators: list[torch.Generator]) -> list[tuple[torch.Generator, list[int]]]:
    """Rows sharing a generator are drawn for in one call, in row order."""
    groups: dict[int, tuple[torch.Generator, list[int]]] = {}
    for i, gen in enumerate(generators):
        groups.setdefault(id(gen), (gen, []))[1].append(i)
    return list(groups.values())


def sample(logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator]) -> list[int]:
    return sample_tensor(logits, temperatures, generators).tolist()


def sample_tensor(logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator]) -> torch.Tensor:
    """The sampled ids as a tensor on the logits' device (no host sync)."""
    if logits.is_cuda and gumbel_argmax is not None:
        return _sample_fused(logits, temperatures, generators)
    greedy = logits.argmax(dim=-1)
    if all(t == 0 for t in temperatures):
        return greedy
    temps = to_device([max(t, 1e-5) for t in temperatures], logits.device, torch.float32)
    probs = torch.softmax(logits.float() / temps.unsqueeze(1), dim=-1)
    noise = torch.empty_like(probs)
    groups = _rows_by_generator(generators)
    for gen, rows in groups:
        if len(rows) == len(generators):
            noise.exponential_(1.0, generator=gen)
        else:
            idx = to_device(rows, logits.device)
            noise[idx] = torch.empty(len(rows), probs.shape[1], device=logits.device).exponential_(1.0, generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = to_device([t == 0 for t in temperatures], logits.device)
    return torch.where(is_greedy, greedy, sampled)


_last_temps: tuple[tuple, torch.Tensor] | None = None


def _device_temperatures(temperatures: list[float], device) -> torch.Tensor:
    """The temperatures as a device tensor; the last one is reused while the list is unchanged (steady decode).
    (Read-only: the sampling kernel does not write it.)"""
    global _last_temps
    key = (str(device), tuple(temperatures))
    if _last_temps is None or _last_temps[0] != key:
        t = to_device(temperatures, device, torch.float32)
        _last_temps = (key, t)
    return _last_temps[1]


def _sample_fused(logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator]) -> torch.Tensor:
    device = logits.device
    n = len(temperatures)
    temps = _device_temperatures(temperatures, device)
    draw = lambda gen, k: torch.randint(0, 2**31 - 1, (k,), generator=gen, device=device)  # noqa: E731
    if all(t == 0 for t in temperatures):
        seeds = torch.zeros(n, dtype=torch.int64, device=device)
    elif all(g is generators[0] for g in generators):      # the common case: the engine's generator only
        seeds = draw(generators[0], n)
    else:
        seeds = torch.empty(n, dtype=torch.int64, device=device)
        for gen, rows in _rows_by_generator(generators):
            seeds[to_device(rows, device)] = draw(gen, len(rows))
    return gumbel_argmax(logits, temps, seeds)


LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass
class TokenLogprob:
    """A chosen (or prompt) token's log-probability, its rank in the vocabulary (1 = most likely) and
    the top alternatives [(token id, log-prob)], most likely first."""
    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class SampledLogprobs:
    """Device tensors for the batch rows that asked for logprobs; to_host() reads them once."""
    rows: list[int]
    counts: list[int]                 # alternatives each row asked for
    chosen: torch.Tensor              # [R] log-prob of the drawn token
    ranks: torch.Tensor               # [R]
    top_ids: torch.Tensor | None      # [R, K]
    top_lps: torch.Tensor | None

    def stage(self) -> None:
        """Queue the copies to pinned host memory now (CUDA, the overlapped decode): the caller records an event
        after them, and to_host() then reads host memory instead of waiting on the stream, where the next step
        may already be running."""
        for name in ("chosen", "ranks", "top_ids", "top_lps"):
            t = getattr(self, name)
            if t is not None and t.is_cuda:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                setattr(self, name, host)

    def to_host(self, tokens: list[int]) -> dict[int, TokenLogprob]:
        chosen, ranks = self.chosen.tolist(), self.ranks.tolist()
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        lps = self.top_lps.tolist() if self.top_lps is not None else None
        out = {}
        for j, (row, k) in enumerate(zip(self.rows, self.counts)):
            top = list(zip(ids[j][:k], lps[j][:k])) if k and ids is not None else []
            out[row] = TokenLogprob(int(tokens[row]), chosen[j], int(ranks[j]), top)
        return out


def logprobs_of(logprobs: torch.Tensor, targets: torch.Tensor, k: int) -> tuple:
    """(target log-probs, ranks, top-k ids, top-k log-probs) of log-prob rows [R, V]."""
    chosen = logprobs.gather(1, targets.long().unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    if k > 0:
        top_lps, top_ids = logprobs.topk(k, dim=-1)
        return chosen, ranks, top_ids, top_lps
    return chosen, ranks, None, None


def sample_processed(logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator],
                     rows: dict[int, RowInputs], logprobs_mode: str = "raw_logprobs",
                     history: TokenHistory | None = None) -> tuple[torch.Tensor, SampledLogprobs | None]:
    """Sample a batch in which `rows` (batch row -> its inputs) need processing; the others take the
    plain path. Returns the ids on the logits' device and the log-probs of the rows that asked for them."""
    dev = logits.device
    n = logits.shape[0]
    proc = sorted(rows)
    plain = [i for i in range(n) if i not in rows]
    out = torch.empty(n, dtype=torch.int64, device=dev)
    if plain:
        idx = to_device(plain, dev)
        ids = sample_tensor(logits.index_select(0, idx), [temperatures[i] for i in plain],
                            [generators[i] for i in plain])
        out.index_copy_(0, idx, ids.long())
    idx = to_device(proc, dev)
    raw = logits.index_select(0, idx)
    inputs = [rows[i] for i in proc]
    processed = process(raw, inputs, history)
    ids = sample_tensor(processed, [1.0 if temperatures[i] > 0 else 0.0 for i in proc],
                        [generators[i] for i in proc]).long()
    out.index_copy_(0, idx, ids)
    want = [j for j, r in enumerate(inputs) if r.params.logprobs is not None]
    if not want:
        return out, None
    sel = to_device(want, dev)
    src = processed if logprobs_mode == "processed_logprobs" else raw.float()
    lp = torch.log_softmax(src.index_select(0, sel), dim=-1)
    counts = [inputs[j].params.logprobs for j in want]
    chosen, ranks, top_ids, top_lps = logprobs_of(lp, ids.index_select(0, sel), max(counts))
    return out, SampledLogprobs([proc[j] for j in want], counts, chosen, ranks, top_ids, top_lps)
