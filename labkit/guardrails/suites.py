"""The guardrail suites: fixed token trajectories, their digests, choices, checkpoint ids and file paths.

Suites:
- ``baseline``: quick-walk cases A-D, each on fresh scheduling state: 15 rows (full prefill, decode,
  mixed-length batching, page crossing at slot 256, chunked prefill under a 512-token budget).
- ``graph``: batches of 1, 9, 16, 17 and 20 requests of different lengths (max_num_seqs 20), each
  prefilled then decoded one step: 126 rows, with the new K/V of every layer per decode row and
  checks that the decode left the batch's history KV and unreferenced blocks untouched.

A collection is PREFIX.json (evidence) plus PREFIX.npz (arrays); the path helpers and the choice
validation live here so that ``collect`` and ``compare`` need not import each other.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from labkit.errors import UserError
from labkit.evidence import file_mode
from labkit.paths import default_out


SUITES = ("baseline", "graph")
BACKENDS = ("nano", "hf")
EXECUTIONS = ("eager", "graph")
ATTENTION_CHOICES = ("auto", "flash_attn", "triton", "torch")
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")     # auto: bfloat16 on CUDA, float32 on CPU
DEFAULT_SEED = 0

#: Preset continuation ids are drawn below Qwen's first special token (<|endoftext|> = 151643).
TOKEN_HIGH = 151643
GRAPH_BATCHES = (1, 9, 16, 17, 20)
GRAPH_MAX_NUM_SEQS = 20
#: The seed commit's buckets for max_num_seqs=20: nothing covers a batch of 17 (handbook B.5).
UNCOVERED_BUCKETS = (1, 2, 4, 8, 16)
UNCOVERED_BATCH = 17

#: New-KV max abs threshold (handbook B.5). The logits thresholds live in one table, by device class and
#: dtype: ``thresholds.logits`` in checkpoints/guardrails.json (``labkit.checks.threshold_entry``).
DEFAULT_KV_MAX_ABS = 0.1

CHECKPOINT_BASELINE = "guardrails.logits-baseline"
CHECKPOINT_BF16_GPU = "guardrails.logits-bf16"       # the baseline guard in bfloat16 on CUDA (no CPU twin: the
                                                     # CPU default model, tiny with random weights, is chaotic in bf16)
CHECKPOINT_TP_CPU = "tp.logits-cpu"          # the baseline guard with --tp N on CPU (gloo)
CHECKPOINT_TP_GPU = "tp.logits-2gpu"         # ... on GPUs (NCCL)
CHECKPOINT_GRAPH = "guardrails.graph-vs-eager"
CHECKPOINT_KV_FP8 = "guardrails.kv-fp8"       # the baseline suite, engine with an FP8 KV cache vs its bf16 cache (CUDA)
CHECKPOINT_UNCOVERED = "guardrails.graph-uncovered"
CHECKPOINT_ROPE = {"yarn": "models.rope-yarn", "linear": "models.rope-linear"}   # the baseline guard, --rope-scaling


@dataclass(frozen=True)
class SuiteRequest:
    group: str
    label: str
    prompt: tuple[int, ...]
    continuation: tuple[int, ...]     # preset next ids: one per output, so one per row

    @property
    def max_tokens(self) -> int:
        return len(self.continuation)


@dataclass(frozen=True)
class SuiteGroup:
    """Requests submitted together on fresh scheduling state."""
    name: str
    title: str
    requests: tuple[SuiteRequest, ...]


@dataclass(frozen=True)
class RowSpec:
    index: int
    group: str
    request: str
    request_index: int                # within its group
    step: int                         # output index: 0 = the prefill row
    tokens: tuple[int, ...]           # the full input prefix of this row

    @property
    def id(self) -> str:
        return f"{self.group}/{self.request}/{self.step}"

    @property
    def phase(self) -> str:
        return "prefill" if self.step == 0 else "decode"


@dataclass(frozen=True)
class Suite:
    name: str
    seed: int
    groups: tuple[SuiteGroup, ...]
    max_num_seqs: int | None          # None: the engine default
    num_kvcache_blocks: int           # a small fixed pool: cheap snapshots, no memory-budget coupling
    budget: int = 512
    block_size: int = 256
    max_model_len: int = 1024

    def rows(self) -> list[RowSpec]:
        out: list[RowSpec] = []
        for g in self.groups:
            for ri, r in enumerate(g.requests):
                for step in range(r.max_tokens):
                    out.append(RowSpec(len(out), g.name, r.label, ri, step, r.prompt + r.continuation[:step]))
        return out

    @property
    def expected_rows(self) -> int:
        return sum(r.max_tokens for g in self.groups for r in g.requests)


def _continuation(rng: np.random.Generator, n: int, high: int) -> tuple[int, ...]:
    return tuple(int(x) for x in rng.integers(0, high, size=n))


def build_suite(name: str, seed: int = DEFAULT_SEED, vocab_size: int | None = None) -> Suite:
    """The suite's fixed trajectory: prompts (fixed or seeded) and seeded continuation ids."""
    if name not in SUITES:
        raise UserError(f"unknown suite {name!r}: choose one of {', '.join(SUITES)}")
    high = min(TOKEN_HIGH, vocab_size or TOKEN_HIGH)
    rng = np.random.default_rng([seed, SUITES.index(name)])
    if name == "baseline":
        from labkit.cases import CASES

        # outputs per request: A 3, B 2 and 5, C 3, D 1 and 1 -> 15 rows
        outputs = {"A": (3,), "B": (2, 5), "C": (3,), "D": (1, 1)}
        groups = []
        for case, counts in outputs.items():
            spec = CASES[case]
            reqs = tuple(SuiteRequest(case, label, tuple(prompt), _continuation(rng, n, high))
                         for label, prompt, n in zip(spec.labels, spec.prompts, counts, strict=True))
            groups.append(SuiteGroup(case, spec.title, reqs))
        return Suite(name, seed, tuple(groups), max_num_seqs=None, num_kvcache_blocks=16)
    groups = []
    for n in GRAPH_BATCHES:
        lengths = [int(x) for x in rng.choice(np.arange(5, 301), size=n, replace=False)]
        if n >= UNCOVERED_BATCH and 256 not in lengths:
            lengths[0] = 256          # its decode writes slot 256: the first position of a new block
        reqs = tuple(SuiteRequest(f"batch-{n}", f"r{i:02d}", tuple(int(x) for x in rng.integers(0, high, size=ln)),
                                  _continuation(rng, 2, high))
                     for i, ln in enumerate(lengths))
        groups.append(SuiteGroup(f"batch-{n}", f"{n} requests of different lengths: prefill, then one decode", reqs))
    return Suite(name, seed, tuple(groups), max_num_seqs=GRAPH_MAX_NUM_SEQS, num_kvcache_blocks=64)


def tokens_sha256(tokens) -> str:
    return hashlib.sha256(np.asarray(list(tokens), dtype=np.int64).tobytes()).hexdigest()


def trajectory(rows: list[RowSpec]) -> list[dict]:
    return [{"index": r.index, "id": r.id, "group": r.group, "request": r.request, "step": r.step,
             "phase": r.phase, "length": len(r.tokens), "tokens_sha256": tokens_sha256(r.tokens)} for r in rows]


def trajectory_sha256(rows: list[RowSpec] | list[dict]) -> str:
    """One digest over every row's id and input tokens (order included)."""
    h = hashlib.sha256()
    for r in rows:
        rid, digest = (r.id, tokens_sha256(r.tokens)) if isinstance(r, RowSpec) else (r["id"], r["tokens_sha256"])
        h.update(f"{rid}:{digest};".encode())
    return h.hexdigest()


def suite_requests(suite: Suite) -> list[dict]:
    return [{"group": g.name, "label": r.label, "prompt_len": len(r.prompt), "prompt": list(r.prompt),
             "continuation": list(r.continuation)} for g in suite.groups for r in g.requests]



def prefix_of(path: str | Path) -> Path:
    """PREFIX from PREFIX, PREFIX.json or PREFIX.npz."""
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".json", ".npz") else p


def json_of(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + ".json")


def npz_of(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + ".npz")


def default_collect_prefix(backend: str, suite: str, execution: str) -> Path:
    name = f"logits-{backend}-{suite}" if backend == "hf" else f"logits-{backend}-{execution}-{suite}"
    return default_out(name)


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    """Write the arrays atomically (temp file in the same directory, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, file_mode())          # the umask's mode, not mkstemp's 0600
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def parse_buckets(text: str | None) -> tuple[int, ...] | None:
    """``"1,2,4,8,16"`` -> (1, 2, 4, 8, 16); None/empty -> None."""
    if text is None or not str(text).strip():
        return None
    try:
        values = tuple(int(x) for x in str(text).replace(" ", "").split(",") if x)
    except ValueError:
        raise UserError(f"--graph-buckets must be comma-separated positive integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise UserError(f"--graph-buckets must be comma-separated positive integers, got {text!r}")
    return tuple(sorted(set(values)))


def validate_choices(suite: str, backend: str, execution: str, attention: str, dtype: str = "auto") -> None:
    if suite not in SUITES:
        raise UserError(f"unknown suite {suite!r}: choose one of {', '.join(SUITES)}")
    if backend not in BACKENDS:
        raise UserError(f"unknown backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if execution not in EXECUTIONS:
        raise UserError(f"unknown execution {execution!r}: choose one of {', '.join(EXECUTIONS)}")
    if attention not in ATTENTION_CHOICES:
        raise UserError(f"unknown attention backend {attention!r}: choose one of {', '.join(ATTENTION_CHOICES)}")
    if dtype not in DTYPE_CHOICES:
        raise UserError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}")
