"""``labkit trace``: a fixed arrival trace as JSONL, the same bytes for the same options.

Line 1 is a header (``"record": "header"``: generator, version, options); every other line is one
request::

    {"record": "request", "request_id": "r003", "index": 3, "class": "long", "arrival_ms": 120.0,
     "arrival_round": 3, "prompt_tokens": 768, "max_tokens": 64, "ignore_eos": true,
     "temperature": 0.0, "prompt_token_ids": [...]}

Requests arrive every ``interval_ms`` (``arrival_ms = index * interval_ms``; ``arrival_round =
index`` for ``load --mode round``); every ``long_every``-th request (index 3, 7, 11 for 4) has the
long prompt. Outputs have a fixed length (``ignore_eos``, greedy) so runs compare equal work.
Token ids are drawn from blake2b over (seed, request, position) in an ordinary-token range that
every Qwen3 vocabulary has (no special tokens), so no RNG or library version changes the file and
no two prompts share a prefix (the prefix cache starts cold for every request).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from labkit.errors import UserError
from labkit.evidence import read_jsonl

TRACE_VERSION = 1
TOKEN_LOW, TOKEN_HIGH = 1000, 150000          # ordinary BPE tokens; Qwen3 specials start at 151643


@dataclass(frozen=True)
class TraceOptions:
    requests: int = 12
    prompt_tokens: int = 32
    long_prompt_tokens: int = 768
    long_every: int = 4
    max_tokens: int = 64
    interval_ms: float = 40.0
    seed: int = 17

    def __post_init__(self) -> None:
        # 40 and 40.0 must give the same bytes
        if isinstance(self.interval_ms, (int, float)) and not isinstance(self.interval_ms, bool):
            object.__setattr__(self, "interval_ms", float(self.interval_ms))

    def check(self) -> None:
        for name in ("requests", "prompt_tokens", "long_prompt_tokens", "max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise UserError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
        if self.long_every < 0:
            raise UserError(f"--long-every must be >= 0 (0: no long prompts), got {self.long_every}")
        if self.interval_ms < 0:
            raise UserError(f"--interval-ms must be >= 0, got {self.interval_ms}")


def token_ids(seed: int, salt: str, n: int) -> list[int]:
    """n ids in [TOKEN_LOW, TOKEN_HIGH) from blake2b(seed, salt, block): stable across versions."""
    span = TOKEN_HIGH - TOKEN_LOW
    out: list[int] = []
    block = 0
    while len(out) < n:
        digest = hashlib.blake2b(f"{seed}:{salt}:{block}".encode(), digest_size=64).digest()
        for i in range(0, 64, 4):
            out.append(TOKEN_LOW + int.from_bytes(digest[i:i + 4], "little") % span)
        block += 1
    return out[:n]


def is_long(index: int, long_every: int) -> bool:
    return long_every > 0 and index % long_every == long_every - 1


def make_trace(opts: TraceOptions) -> list[dict]:
    opts.check()
    out = []
    for i in range(opts.requests):
        long = is_long(i, opts.long_every)
        n = opts.long_prompt_tokens if long else opts.prompt_tokens
        out.append({
            "record": "request", "request_id": f"r{i:03d}", "index": i, "class": "long" if long else "short",
            "arrival_ms": round(i * opts.interval_ms, 3), "arrival_round": i, "prompt_tokens": n,
            "max_tokens": opts.max_tokens, "ignore_eos": True, "temperature": 0.0,
            "prompt_token_ids": token_ids(opts.seed, f"r{i}", n),
        })
    return out


def header(opts: TraceOptions) -> dict:
    return {"record": "header", "generator": "labkit trace", "version": TRACE_VERSION, "options": asdict(opts),
            "token_range": [TOKEN_LOW, TOKEN_HIGH]}


def render_records(head: dict, reqs: list[dict]) -> str:
    return "".join(json.dumps(rec, separators=(",", ":"), sort_keys=False) + "\n" for rec in [head, *reqs])


def render(opts: TraceOptions) -> str:
    return render_records(header(opts), make_trace(opts))


def write_text(out: str | Path, text: str) -> tuple[Path, str]:
    """Write the trace's bytes; (path, sha256 of them)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode())
    return path, hashlib.sha256(text.encode()).hexdigest()


def write_trace(out: str | Path, opts: TraceOptions) -> dict:
    """Write the trace; returns a summary (path, requests per class, sha256 of the bytes)."""
    path, sha = write_text(out, render(opts))
    reqs = make_trace(opts)
    return {"path": str(path), "requests": len(reqs),
            "short": sum(r["class"] == "short" for r in reqs), "long": sum(r["class"] == "long" for r in reqs),
            "span_ms": reqs[-1]["arrival_ms"] if reqs else 0.0, "sha256": sha}


def read_trace(path: str | Path) -> tuple[dict | None, list[dict]]:
    """(header or None, request records sorted by arrival); one-line UserError for a bad file."""
    path = Path(path)
    head, reqs = None, []
    for n, rec in read_jsonl(path, missing="trace not found"):
        if rec.get("record") == "header":
            head = rec
            continue
        if "request_id" not in rec or "prompt_token_ids" not in rec:
            raise UserError(f"{path}:{n}: a request needs request_id and prompt_token_ids")
        rec.setdefault("arrival_ms", 0.0)
        rec.setdefault("arrival_round", len(reqs))
        rec.setdefault("max_tokens", 64)
        rec.setdefault("class", "all")
        rec.setdefault("prompt_tokens", len(rec["prompt_token_ids"]))
        reqs.append(rec)
    ids = [r["request_id"] for r in reqs]
    if len(set(ids)) != len(ids):
        raise UserError(f"{path}: request ids are not unique")
    if not reqs:
        raise UserError(f"{path}: no requests")
    reqs.sort(key=lambda r: (r["arrival_ms"], r["arrival_round"]))
    return head, reqs


def warmup_requests(reqs: list[dict], n: int, seed: int = 0, salt: str = "warmup") -> list[dict]:
    """n warmup requests shaped like the trace's classes (short first, then long, ...) with their own
    prefixes, so the measured requests still start from a cold prefix cache."""
    by_class: dict[str, dict] = {}
    for r in reqs:
        by_class.setdefault(r["class"], r)
    shapes = list(by_class.values()) or reqs[:1]
    out = []
    for i in range(n):
        src = shapes[i % len(shapes)]
        out.append({"record": "request", "request_id": f"warmup-{i}", "index": -1 - i, "class": src["class"],
                    "arrival_ms": 0.0, "arrival_round": 0, "prompt_tokens": src["prompt_tokens"],
                    "max_tokens": src["max_tokens"], "ignore_eos": True, "temperature": 0.0,
                    "prompt_token_ids": token_ids(seed, f"{salt}{i}", len(src["prompt_token_ids"])), "warmup": True})
    return out
