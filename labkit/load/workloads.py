"""``labkit trace --dataset ...``: traces shaped like production load (vLLM ``bench serve``'s meanings).

Arrivals
    ``request_rate`` R requests/s (``inf``: all at ``arrival_ms = 0``); inter-arrival gaps are gamma with
    shape ``burstiness`` B and mean 1/R (B = 1: exponential gaps, a Poisson process; B < 1 burstier,
    B > 1 more even; the gaps' coefficient of variation is 1/sqrt(B)). The first request arrives at 0.
    A fixed count (``num_requests``) or every arrival before ``duration_s``.
Lengths
    ``length_dist uniform``: integers in [len*(1-r), len*(1+r)] (r = ``range_ratio``; 0 = fixed);
    ``lognormal``: round(len * exp(N(0, sigma))), at least 1 (median len). Both the prompt
    (``input_len``) and the output (``output_len``, ``ignore_eos``) are drawn.
Datasets
    ``random``: each prompt its own tokens (no shared prefixes).
    ``prefix-repetition``: ``num_prefixes`` N prefixes of ``prefix_len`` P tokens; the requests are
    split evenly over them (index i gets prefix i mod N, then shuffled) and each gets a fresh suffix
    of ``suffix_len`` S tokens: prompt = prefix + suffix (P + S tokens), ``prefix_index`` recorded.
    ``multi-turn``: ``sessions`` K conversations of ``turns`` T turns. Session k's first turn arrives
    by the arrival process; turn t (t >= 1) is the previous turn's prompt + a stand-in for its reply
    (``output_len`` tokens of the trace's own, since the real reply is unknown when the trace is
    written) + a new user message (``input_len`` drawn), so the conversation grows and each turn's
    prompt starts with the previous one. Turn t records ``after`` (the previous turn's request id)
    and ``think_time_ms``: ``labkit load`` sends it that long after the previous turn finished. Its
    ``arrival_ms`` is only a lower bound (previous arrival + think time) that keeps the file ordered.

Randomness: ``random.Random(seed)`` for gaps, lengths and the prefix shuffle (stable across CPython
versions for these calls), ``trace.token_ids`` (blake2b) for token ids; the options are the header.
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

from labkit.errors import UserError
from labkit.load.trace import TOKEN_HIGH, TOKEN_LOW, TRACE_VERSION, token_ids

DATASETS = ("random", "prefix-repetition", "multi-turn")
LENGTH_DISTS = ("uniform", "lognormal")
MAX_REQUESTS = 1_000_000


@dataclass(frozen=True)
class WorkloadOptions:
    dataset: str = "random"
    request_rate: float = math.inf
    burstiness: float = 1.0
    num_requests: int | None = None       # default 100 when neither this nor duration_s is given
    duration_s: float | None = None
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    length_dist: str = "uniform"
    sigma: float = 0.5
    num_prefixes: int = 4
    prefix_len: int = 256
    suffix_len: int = 32
    sessions: int = 4
    turns: int = 3
    think_time_ms: float = 0.0
    seed: int = 17

    def check(self) -> None:
        if self.dataset not in DATASETS:
            raise UserError(f"--dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.length_dist not in LENGTH_DISTS:
            raise UserError(f"--length-dist must be one of {', '.join(LENGTH_DISTS)}, got {self.length_dist!r}")
        if not self.request_rate > 0:
            raise UserError(f"--request-rate must be > 0 requests/s (inf: all at once), got {self.request_rate}")
        if not (self.burstiness > 0 and math.isfinite(self.burstiness)):
            raise UserError(f"--burstiness must be a finite number > 0 (1: Poisson), got {self.burstiness}")
        if self.num_requests is not None and self.duration_s is not None:
            raise UserError("give --num-requests or --duration, not both")
        if self.duration_s is not None:
            if not (self.duration_s > 0 and math.isfinite(self.duration_s)):
                raise UserError(f"--duration must be a finite number of seconds > 0, got {self.duration_s}")
            if math.isinf(self.request_rate):
                raise UserError("--duration needs a finite --request-rate (inf sends everything at 0)")
        if self.dataset == "multi-turn" and (self.num_requests is not None or self.duration_s is not None):
            raise UserError("--dataset multi-turn has --sessions x --turns requests; leave out --num-requests/--duration")
        ints = ["input_len", "output_len", "num_prefixes", "prefix_len", "suffix_len", "sessions", "turns"]
        if self.num_requests is not None:
            ints.append("num_requests")
        for name in ints:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if not 0 <= self.range_ratio < 1:
            raise UserError(f"--range-ratio must be in [0, 1), got {self.range_ratio}")
        if not (self.sigma >= 0 and math.isfinite(self.sigma)):
            raise UserError(f"--sigma must be a finite number >= 0, got {self.sigma}")
        if not (self.think_time_ms >= 0 and math.isfinite(self.think_time_ms)):
            raise UserError(f"--think-time-ms must be a finite number >= 0, got {self.think_time_ms}")
        if self.num_requests is not None and self.num_requests > MAX_REQUESTS:
            raise UserError(f"--num-requests must be at most {MAX_REQUESTS}, got {self.num_requests}")
        if self.duration_s is not None and self.duration_s * self.request_rate > MAX_REQUESTS:
            raise UserError(f"--duration x --request-rate would give over {MAX_REQUESTS} requests")


def arrivals_ms(opts: WorkloadOptions, rng: random.Random, count: int | None) -> list[float]:
    """count arrival times (or all before duration_s); gaps gamma(shape B, mean 1/R), the first at 0."""
    if math.isinf(opts.request_rate):
        return [0.0] * int(count or 0)
    scale_s = 1.0 / (opts.request_rate * opts.burstiness)
    out, t = [], 0.0
    while True:
        if count is not None and len(out) >= count:
            return out
        if count is None and t >= opts.duration_s:
            return out
        out.append(round(t * 1000.0, 3))
        t += rng.gammavariate(opts.burstiness, scale_s)


def draw_len(opts: WorkloadOptions, rng: random.Random, mean: int) -> int:
    if opts.length_dist == "lognormal":
        return max(1, round(mean * math.exp(rng.gauss(0.0, opts.sigma))))
    low, high = max(1, math.floor(mean * (1 - opts.range_ratio))), math.ceil(mean * (1 + opts.range_ratio))
    return rng.randint(low, high)


def _request(i: int, cls: str, arrival: float, ids: list[int], max_tokens: int, **extra) -> dict:
    return {"record": "request", "request_id": f"r{i:04d}", "index": i, "class": cls, "arrival_ms": arrival,
            "arrival_round": i, "prompt_tokens": len(ids), "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0, **extra, "prompt_token_ids": ids}


def _count(opts: WorkloadOptions) -> int | None:
    return None if opts.duration_s is not None else (opts.num_requests or 100)


def random_requests(opts: WorkloadOptions, rng: random.Random) -> list[dict]:
    out = []
    for i, t in enumerate(arrivals_ms(opts, rng, _count(opts))):
        n_in, n_out = draw_len(opts, rng, opts.input_len), draw_len(opts, rng, opts.output_len)
        out.append(_request(i, "random", t, token_ids(opts.seed, f"r{i}", n_in), n_out))
    return out


def prefix_requests(opts: WorkloadOptions, rng: random.Random) -> list[dict]:
    times = arrivals_ms(opts, rng, _count(opts))
    which = [i % opts.num_prefixes for i in range(len(times))]
    rng.shuffle(which)
    prefixes = [token_ids(opts.seed, f"prefix{j}", opts.prefix_len) for j in range(opts.num_prefixes)]
    out = []
    for i, (t, j) in enumerate(zip(times, which)):
        ids = prefixes[j] + token_ids(opts.seed, f"suffix{i}", opts.suffix_len)
        out.append(_request(i, "prefix-repetition", t, ids, draw_len(opts, rng, opts.output_len), prefix_index=j))
    return out


def multi_turn_requests(opts: WorkloadOptions, rng: random.Random) -> list[dict]:
    starts = arrivals_ms(opts, rng, opts.sessions)
    out = []
    for k, start in enumerate(starts):
        prompt: list[int] = []
        prev = None
        arrival = start
        for t in range(opts.turns):
            i = k * opts.turns + t
            if prev is not None:
                reply = token_ids(opts.seed, f"s{k}reply{t - 1}", prev["max_tokens"])
                prompt = prev["prompt_token_ids"] + reply
                arrival = round(arrival + opts.think_time_ms, 3)
            prompt = prompt + token_ids(opts.seed, f"s{k}user{t}", draw_len(opts, rng, opts.input_len))
            dep = {} if prev is None else {"after": prev["request_id"], "think_time_ms": opts.think_time_ms}
            rec = _request(i, "multi-turn", arrival, prompt, draw_len(opts, rng, opts.output_len),
                           session=f"s{k:03d}", turn=t, **dep)
            out.append(rec)
            prev = rec
    return out


def make_workload(opts: WorkloadOptions) -> list[dict]:
    opts.check()
    rng = random.Random(opts.seed)
    make = {"random": random_requests, "prefix-repetition": prefix_requests,
            "multi-turn": multi_turn_requests}[opts.dataset]
    return make(opts, rng)


def workload_header(opts: WorkloadOptions) -> dict:
    options = {k: (str(v) if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(opts).items()}
    return {"record": "header", "generator": "labkit trace", "version": TRACE_VERSION, "dataset": opts.dataset,
            "options": options, "token_range": [TOKEN_LOW, TOKEN_HIGH]}


def write_workload(out, opts: WorkloadOptions, header_only: bool = False) -> dict:
    """Write a workload trace; returns a summary (path, counts, span, sha256 of the bytes). ``header_only``:
    the header line alone (the options: a rate sweep's base, ``labkit load --request-rates``)."""
    from labkit.load.trace import render_records, write_text

    reqs = make_workload(opts)
    path, sha = write_text(out, render_records(workload_header(opts), [] if header_only else reqs))
    if header_only:
        return {"path": str(path), "dataset": opts.dataset, "requests": 0, "header_only": True, "sha256": sha}
    prompt = [r["prompt_tokens"] for r in reqs]
    summary = {"path": str(path), "dataset": opts.dataset, "requests": len(reqs),
               "span_ms": max((r["arrival_ms"] for r in reqs), default=0.0),
               "prompt_tokens_mean": round(sum(prompt) / len(prompt), 1) if prompt else 0.0,
               "max_tokens_total": sum(r["max_tokens"] for r in reqs), "sha256": sha}
    if opts.dataset == "multi-turn":
        summary["dependent_turns"] = sum("after" in r for r in reqs)
    return summary
