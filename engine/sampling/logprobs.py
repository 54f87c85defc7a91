"""Log-probabilities: of the drawn tokens (batch rows that asked, read once on the host) and of the prompt's
tokens (prompt_logprobs, recorded on the sequence during its prefill).

Of the model's raw distribution (vLLM's default ``raw_logprobs``) unless the engine runs with
``logprobs_mode="processed_logprobs"`` (the drawn tokens' then come from the processed logits).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

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


#: Prompt positions whose log-softmax over the vocabulary is computed at once: the extra memory of prompt log-probs
#: is O(PROMPT_LOGPROBS_CHUNK x vocab) (about 78 MB in float32 at Qwen3's 151,936 ids), whatever the prompt's length.
PROMPT_LOGPROBS_CHUNK = 128


def prompt_logprobs_chunk(rows: torch.Tensor, targets: list[int], k: int,
                          compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> list[TokenLogprob]:
    """The TokenLogprob of each target token at hidden rows [n, H] (n <= PROMPT_LOGPROBS_CHUNK): logits,
    log-softmax, chosen, rank, top-k of this chunk only."""
    lp = torch.log_softmax(compute_logits(rows).float(), dim=-1)
    tgt = torch.tensor(targets, device=lp.device)
    chosen, ranks, top_ids, top_lps = logprobs_of(lp, tgt, k)
    del lp
    ids = top_ids.tolist() if top_ids is not None else None
    lps = top_lps.tolist() if top_lps is not None else None
    return [TokenLogprob(t, c, int(r), list(zip(ids[j], lps[j])) if ids is not None else [])
            for j, (t, c, r) in enumerate(zip(targets, chosen.tolist(), ranks.tolist()))]


def record_prompt_logprobs(seqs: list, seqlens_q: list[int], hidden: torch.Tensor,
                           compute_logits: Callable[[torch.Tensor], torch.Tensor],
                           chunk: int | None = None) -> None:
    """After a prefill's forward (hidden: every position's hidden state, the sequences' chunks back to back):
    for the sequences asking for prompt log-probs, the log-softmax of the raw logits at every position of
    their chunk, appending the next prompt token's log-prob (with its top alternatives) to
    seq.prompt_logprobs. Computed ``chunk`` positions (default PROMPT_LOGPROBS_CHUNK) at a time, so a long
    prompt never holds its whole [positions, vocab] logits at once. Positions already recorded (a recompute
    after preemption) are skipped."""
    step = chunk or PROMPT_LOGPROBS_CHUNK
    offset = 0
    for seq, n in zip(seqs, seqlens_q):
        if not seq.prompt_logprobs_done:
            start = seq.num_cached_tokens
            done = len(seq.prompt_logprobs)            # positions whose next token is recorded, + 1
            first = max(start, done - 1)
            last = min(start + n, seq.num_prompt_tokens - 1)   # position p predicts token p + 1
            k = seq.sampling_params.prompt_logprobs
            for a in range(first, last, step):
                b = min(a + step, last)
                rows = hidden[offset + a - start: offset + b - start]
                seq.prompt_logprobs += prompt_logprobs_chunk(rows, seq.token_ids[a + 1: b + 1], k, compute_logits)
        offset += n
