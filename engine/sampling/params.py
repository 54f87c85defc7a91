"""One request's sampling settings, with vLLM's names, ranges and meanings.

Order the sampler applies them in (engine/sampling/processors.py, as vLLM's v1 sampler):
min_tokens (EOS and stop_token_ids masked) and logit_bias, then the repetition / frequency / presence
penalties; temperature 0 takes the argmax here; otherwise temperature, then min_p, then top_k and top_p,
then the draw. ``logprobs`` / ``prompt_logprobs`` are of the model's raw distribution (vLLM's default
``raw_logprobs``), unless the engine runs with ``logprobs_mode="processed_logprobs"``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import RequestError
from engine.sampling.structured import StructuredOutputsParams

MAX_LOGPROBS = 20               # top alternatives per token, as OpenAI and vLLM's default max_logprobs
#: logit_bias entries per request. This server's bound (neither OpenAI's reference nor vLLM documents one): a
#: request's biases are turned into one pair of index tensors once and scattered into the batch's logits in
#: one index_put per step, so a row costs at most this many scatter entries; 1024 keys is about 12 KB of JSON.
MAX_LOGIT_BIAS = 1024


def _bad(name: str, message: str) -> RequestError:
    """A refused field: its name leads the message and names the code (``invalid_<name>``), which the server's
    400 names as the request's field. The ranges are stated here only; the server checks JSON types."""
    return RequestError(f"{name} {message}", f"invalid_{name}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplingParams:
    temperature: float = 1.0      # 0 = greedy
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int | None = None
    top_p: float = 1.0            # (0, 1]; 1 = off
    top_k: int = -1               # -1 or 0 = off, else >= 1
    min_p: float = 0.0            # [0, 1]; 0 = off
    presence_penalty: float = 0.0     # [-2, 2], over output tokens
    frequency_penalty: float = 0.0    # [-2, 2], over output tokens
    repetition_penalty: float = 1.0   # > 0, over prompt and output tokens; 1 = off
    logit_bias: dict[int, float] | None = None    # token id -> bias in [-100, 100], at most MAX_LOGIT_BIAS entries
    allowed_token_ids: list[int] | None = None    # only these ids can be drawn (vLLM's; None = all; never empty)
    min_tokens: int = 0           # EOS and stop_token_ids are masked until this many outputs
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None           # None, or 0..20 alternatives beside the chosen token's log-prob
    prompt_logprobs: int | None = None    # None, or 0..20 (every prompt position but the first)
    n: int = 1                    # samples of the same prompt (LLM.generate; the server expands it itself)
    best_of: int | None = None    # only None or n (no ranking of extra samples)
    structured_outputs: StructuredOutputsParams | None = None   # a grammar the output follows (a dict is converted)

    def __post_init__(self) -> None:
        if not _is_num(self.temperature) or self.temperature < 0:
            raise _bad("temperature", f"must be >= 0, got {self.temperature}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise _bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not _is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise _bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", f"must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        if not _is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise _bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2 <= v <= 2:
                raise _bad(name, f"must be in [-2, 2], got {v!r}")
        if not _is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise _bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise _bad("logit_bias", f"must map token ids to biases, got {self.logit_bias!r}")
            for k, b in self.logit_bias.items():
                if not _is_int(k) or k < 0:
                    raise _bad("logit_bias", f"keys must be token ids, got {k!r}")
                if not _is_num(b) or not -100 <= b <= 100:
                    raise _bad("logit_bias", f"values must be in [-100, 100], got {b!r} for token {k}")
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise _bad("logit_bias", f"may hold at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
            self.logit_bias = {int(k): float(b) for k, b in self.logit_bias.items()} or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not all(_is_int(t) and t >= 0 for t in ids):
                raise _bad("allowed_token_ids", f"must be a list of token ids, got {ids!r}")
            if not ids:
                raise _bad("allowed_token_ids", "must not be empty (null allows every token)")
            self.allowed_token_ids = list(dict.fromkeys(int(t) for t in ids))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _bad("min_tokens", f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise _bad("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise _bad(name, f"must be null or an integer in [0, {MAX_LOGPROBS}], got {v!r}")
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", f"must be a positive integer, got {self.n!r}")
        if self.best_of is not None and self.best_of != self.n:
            raise _bad("best_of", f"must equal n ({self.n}) or be null (no ranking of extra samples), got {self.best_of!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise _bad("seed", f"must be an integer, got {self.seed!r}")
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        self._penalties = self.has_penalties     # read per row per step (needs_history): computed once
        # _plain: nothing beyond temperature (the sampler's one per-row test); a constrained row is not
        # plain but still takes the plain draw when needs_processing() says so (its mask is applied first)
        self._plain = not (self.has_penalties or self.logit_bias is not None or self.logprobs is not None
                           or self.allowed_token_ids is not None
                           or (self.temperature > 0 and self.has_truncation) or self.min_tokens > 0
                           or self.structured_outputs is not None)
        self._device_cache: dict = {}     # processors' index tensors of logit_bias / allowed_token_ids, per device

    # -- what the sampler needs to do for this request -----------------------------------
    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def has_truncation(self) -> bool:
        return self.top_p < 1 or self.top_k > 0 or self.min_p > 0

    def needs_processing(self, num_outputs: int) -> bool:
        """Whether this row leaves the plain (temperature-only) sampling path at a step where the
        sequence has num_outputs tokens already."""
        if self._plain:
            return False
        return (self._penalties or self.logit_bias is not None or self.logprobs is not None
                or self.allowed_token_ids is not None or (self.temperature > 0 and self.has_truncation)
                or num_outputs < self.min_tokens)

    def needs_history(self, num_outputs: int) -> bool:
        """Whether this step's processing reads the tokens generated so far (penalties, min_tokens, a
        grammar's state: its mask depends on the last token)."""
        return self._penalties or num_outputs < self.min_tokens or self.structured_outputs is not None
