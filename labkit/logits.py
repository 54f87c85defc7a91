"""Numerical guardrails (handbook 5.2.5, B.5, B.8.1): teacher-forced logits, collected and compared.

Both implementations walk the same fixed token trajectory. Each *row* is the full logits vector of the
last position of one request at one step: the step where its prefill completes (step 0) and every
decode step after it. The next input id is preset (seeded), never sampled, so two implementations see
identical inputs at every row no matter how close their top-2 scores are.

- nano: the real Scheduler, BlockManager, ModelRunner and paged KV cache. The sampler is bypassed:
  ``engine.runner.compute_logits`` gives the logits, the preset id goes to ``engine.postprocess``. An
  intermediate chunk of a chunked prefill yields a candidate that postprocess discards; it is no row.
- hf: transformers' Qwen3ForCausalLM on the same directory, eager attention, ``use_cache=False``: every
  row recomputes its whole prefix with position ids 0..n-1. BF16 on CUDA, float32 on CPU.

A collection is PREFIX.json (evidence: trajectory, model identity, engine config, routes, checks) plus
PREFIX.npz (``logits`` [rows, vocab] float32; for the nano graph suite also ``kv_new``
[decode rows, 2, layers, kv heads, head dim] and ``kv_rows``, the row index of each of them).

Suites:
- ``baseline``: quick-walk cases A-D, each on fresh scheduling state: 15 rows (full prefill, decode,
  mixed-length batching, page crossing at slot 256, chunked prefill under a 512-token budget).
- ``graph``: batches of 1, 9, 16, 17 and 20 requests of different lengths (max_num_seqs 20), each
  prefilled then decoded one step: 126 rows, with the new K/V of every layer per decode row and
  checks that the decode left the batch's history KV and unreferenced blocks untouched.

Plain functions; the Typer shells live in :mod:`labkit.logits_commands`.
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import numpy as np

from labkit.errors import UserError
from labkit.evidence import default_out, read_json, write_evidence

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

#: Handbook 5.2.5 / B.5 starting thresholds (to be calibrated on the GPU).
DEFAULT_MAX_ABS = 0.5
DEFAULT_REL_L2 = 0.02
DEFAULT_KV_MAX_ABS = 0.1

CHECKPOINT_BASELINE = "guardrails.logits-baseline"
CHECKPOINT_TP_CPU = "tp.logits-cpu"          # the baseline guard with --tp N on CPU (gloo)
CHECKPOINT_TP_GPU = "tp.logits-2gpu"         # ... on GPUs (NCCL)
CHECKPOINT_GRAPH = "guardrails.graph-vs-eager"
CHECKPOINT_UNCOVERED = "guardrails.graph-uncovered"


# =========================================================================== suites


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
        from labkit.experiments.quick_walk import CASES

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


# =========================================================================== teacher forcing


class ForcedRow(NamedTuple):
    """One teacher-forced row in the order the engine produced it."""
    tokens: list[int]
    logits: Any        # torch.Tensor [vocab], float32, detached copy
    phase: str


@dataclass
class ForcedRecord:
    request: int                     # index into the prompts passed in
    output_index: int                # 0 = the prefill row
    tokens: list[int]
    logits: Any
    phase: str
    engine_step: int


@dataclass
class ForcedStep:
    engine_step: int
    phase: str
    requests: list[int]              # request index of each scheduled sequence, in batch order
    completing: list[bool]           # False: an intermediate chunk, its candidate is discarded
    route: dict = field(default_factory=dict)


class StepProbe:
    """Hooks around each forward (subclass): ``before`` after scheduling, ``after`` before postprocess."""

    def before(self, engine, seqs, is_prefill: bool, requests: list[int]) -> None:
        pass

    def after(self, engine, seqs, is_prefill: bool, requests: list[int], logits) -> None:
        pass


def last_route(engine) -> dict:
    """The route of the runner's last forward; engines without the probe are eager."""
    runner = engine.runner
    route = getattr(runner, "last_route", None)
    if not isinstance(route, dict):
        route = {"backend": runner.attention_backend, "route": "eager", "bucket": None}
    return {"backend": route.get("backend"), "route": route.get("route"), "bucket": route.get("bucket")}


def drive_teacher_forced(engine, prompts, continuations, *, probe: StepProbe | None = None,
                         on_row: Callable[[ForcedRecord], None] | None = None
                         ) -> tuple[list[ForcedRecord], list[ForcedStep]]:
    """Run the real scheduler until every request is done, handing it preset next ids.

    ``continuations[i]`` holds request i's next ids; its length is its max_tokens (one row per output).
    Returns the rows in the order the engine produced them and one entry per engine step.
    """
    from engine import SamplingParams

    index: dict[int, int] = {}
    for i, (p, c) in enumerate(zip(prompts, continuations, strict=True)):
        if not c:
            raise ValueError(f"request {i} has no continuation ids")
        seq = engine.add_request(list(p), SamplingParams(temperature=0.0, max_tokens=len(c), ignore_eos=True))
        index[seq.seq_id] = i
    records: list[ForcedRecord] = []
    steps: list[ForcedStep] = []
    while not engine.is_finished():
        seqs, is_prefill = engine.schedule()
        if not seqs:
            raise RuntimeError("the scheduler returned an empty batch while requests remain")
        requests = [index[s.seq_id] for s in seqs]
        if probe is not None:
            probe.before(engine, seqs, is_prefill, requests)
        logits = engine.runner.compute_logits(seqs, is_prefill)
        route = last_route(engine)
        if probe is not None:
            probe.after(engine, seqs, is_prefill, requests, logits)
        phase = "prefill" if is_prefill else "decode"
        forced, completing = [], []
        for seq, i, row in zip(seqs, requests, logits):
            done = seq.step_reaches_end
            completing.append(done)
            if done:
                rec = ForcedRecord(i, seq.num_completion_tokens, list(seq.token_ids),
                                   row.detach().float().cpu().clone(), phase, engine.num_steps)
                records.append(rec)
                if on_row is not None:
                    on_row(rec)
                forced.append(int(continuations[i][seq.num_completion_tokens]))
            else:
                forced.append(-1)            # an intermediate chunk: postprocess discards it
        steps.append(ForcedStep(engine.num_steps, phase, requests, completing, route))
        engine.postprocess(seqs, forced, is_prefill)
    return records, steps


def teacher_forced(engine, prompts, continuations) -> list[ForcedRow]:
    """(input tokens, logits, phase) for every row, in the order the engine produced them."""
    records, _ = drive_teacher_forced(engine, prompts, continuations)
    return [ForcedRow(r.tokens, r.logits, r.phase) for r in records]


def fresh_scheduling_state(engine) -> None:
    """A new BlockManager and Scheduler on the same runner: no queue, no prefix cache, all blocks free."""
    from engine.block_manager import BlockManager
    from engine.scheduler import Scheduler

    if not engine.is_finished():
        raise RuntimeError("fresh scheduling state asked for while requests are in flight")
    engine.block_manager = BlockManager(engine.runner.num_kvcache_blocks, engine.config.kvcache_block_size)
    engine.scheduler = Scheduler(engine.config, engine.block_manager)


# =========================================================================== KV probe (graph suite)


def _kv_flat(engine):
    """The KV pool as [2, layers, num_blocks * block_size, kv heads, head dim] (a view)."""
    kv = engine.runner.kv_cache
    return kv.view(kv.shape[0], kv.shape[1], kv.shape[2] * kv.shape[3], kv.shape[4], kv.shape[5])


def _slot(seq, position: int, block_size: int) -> int:
    return seq.block_table[position // block_size] * block_size + position % block_size


class KVProbe(StepProbe):
    """Per decode step: K/V written at the new positions, history untouched, unreferenced blocks untouched."""

    def __init__(self, free_sample: int = 16):
        self.free_sample = free_sample
        self.new_kv: dict[tuple[str, int, int], np.ndarray] = {}   # (group, request, output) -> [2, L, H, D]
        self.steps: list[dict] = []
        self.group = ""
        self._history = None
        self._free = None
        self._free_ids: list[int] = []
        self._hist_slots = None

    def before(self, engine, seqs, is_prefill, requests):
        if is_prefill:
            return
        import torch

        bs = engine.config.kvcache_block_size
        flat = _kv_flat(engine)
        slots = [_slot(s, p, bs) for s in seqs for p in range(s.num_tokens - 1)]
        self._hist_slots = torch.tensor(slots, dtype=torch.long, device=flat.device)
        self._history = flat.index_select(2, self._hist_slots).clone()
        free = sorted(engine.block_manager.free_block_ids)
        last = engine.runner.num_kvcache_blocks - 1
        pick = free[: self.free_sample // 2] + free[-(self.free_sample // 2):]
        pick += [b for b in (0, last) if b in free]          # where a padding row with slot 0 / -1 would land
        self._free_ids = sorted(set(pick))
        ids = torch.tensor(self._free_ids, dtype=torch.long, device=flat.device)
        self._free = engine.runner.kv_cache.index_select(2, ids).clone() if self._free_ids else None

    def after(self, engine, seqs, is_prefill, requests, logits):
        if is_prefill:
            return
        import torch

        bs = engine.config.kvcache_block_size
        flat = _kv_flat(engine)
        history_same = bool(torch.equal(flat.index_select(2, self._hist_slots), self._history))
        if self._free is not None:
            ids = torch.tensor(self._free_ids, dtype=torch.long, device=flat.device)
            free_same = bool(torch.equal(engine.runner.kv_cache.index_select(2, ids), self._free))
        else:
            free_same = True
        new_slots = torch.tensor([_slot(s, s.num_tokens - 1, bs) for s in seqs], dtype=torch.long, device=flat.device)
        new = flat.index_select(2, new_slots).float().cpu().numpy()          # [2, L, N, H, D]
        for j, (seq, i) in enumerate(zip(seqs, requests)):
            self.new_kv[(self.group, i, seq.num_completion_tokens)] = np.ascontiguousarray(new[:, :, j])
        self.steps.append({"group": self.group, "engine_step": engine.num_steps, "batch": len(seqs),
                           "history_positions": int(self._hist_slots.numel()), "history_unchanged": history_same,
                           "free_blocks_checked": list(self._free_ids), "free_blocks_unchanged": free_same})
        self._history = self._free = self._hist_slots = None


# =========================================================================== paths, files


def prefix_of(path: str | Path) -> Path:
    """PREFIX from PREFIX, PREFIX.json or PREFIX.npz."""
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".json", ".npz") else p


def _json_of(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + ".json")


def _npz_of(prefix: Path) -> Path:
    return prefix.with_name(prefix.name + ".npz")


def default_collect_prefix(backend: str, suite: str, execution: str) -> Path:
    name = f"logits-{backend}-{suite}" if backend == "hf" else f"logits-{backend}-{execution}-{suite}"
    return default_out(name)


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    """Write the arrays atomically (temp file in the same directory, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
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


def _check(name: str, passed: bool, expected: Any = None, actual: Any = None, why: str = "", status: str | None = None) -> dict:
    c = {"name": name, "passed": bool(passed), "expected": expected, "actual": actual, "why": why}
    if status is not None:
        c["status"] = status
    return c


def _free_torch(device: str) -> None:
    gc.collect()
    if str(device).startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


# =========================================================================== collect: nano


def _configured_buckets(engine) -> list[int] | None:
    graphs = getattr(engine.runner, "graphs", None)
    if graphs is not None and getattr(graphs, "buckets", None):
        return sorted(int(b) for b in graphs.buckets)
    cfg = engine.config
    if getattr(cfg, "graph_buckets", None):
        return sorted(b for b in cfg.graph_buckets if b <= cfg.max_num_seqs) or [min(cfg.graph_buckets)]
    try:
        from engine.graph import default_buckets
    except ImportError:
        return None
    return list(default_buckets(cfg.max_num_seqs))


def expected_route(execution: str, phase: str, batch: int, buckets: list[int] | None) -> tuple[str, int | None]:
    """Prefill and eager execution run eagerly; a decode under graph execution replays the smallest
    covering bucket, or runs eagerly when no bucket covers the batch."""
    if execution != "graph" or phase == "prefill":
        return "eager", None
    covering = [b for b in (buckets or []) if b >= batch]
    return ("graph", min(covering)) if covering else ("eager", None)


def collect_nano(suite_name: str, out: str | Path | None = None, *, model: str | None = None, device: str = "auto",
                 attention: str = "auto", execution: str = "eager", graph_buckets: tuple[int, ...] | None = None,
                 expect_uncovered: bool = False, seed: int = DEFAULT_SEED, dtype: str = "auto",
                 progress: Callable[[int], None] | None = None, tp: int = 1) -> dict:
    """Teacher-forced logits of the embedded engine along ``suite_name``; writes PREFIX.json and PREFIX.npz."""
    from labkit.experiments.common import build_engine, detect_device, synthetic_note

    _validate_choices(suite_name, "nano", execution, attention, dtype)
    device = detect_device(device)
    if execution == "graph" and not device.startswith("cuda"):
        raise UserError("graph execution needs CUDA")
    if graph_buckets and execution != "graph":
        raise UserError("--graph-buckets only applies to --execution graph")
    if expect_uncovered:
        if suite_name != "graph" or execution != "graph":
            raise UserError("--expect-uncovered needs --suite graph --execution graph")
        graph_buckets = graph_buckets or UNCOVERED_BUCKETS
        if any(UNCOVERED_BATCH <= b <= GRAPH_MAX_NUM_SEQS for b in graph_buckets):
            raise UserError(f"--expect-uncovered needs --graph-buckets that leave batch {UNCOVERED_BATCH} uncovered "
                            f"(max_num_seqs {GRAPH_MAX_NUM_SEQS}), got {','.join(map(str, graph_buckets))}")
    if tp < 1:
        raise UserError(f"--tp must be >= 1, got {tp}")
    if tp > 1 and suite_name != "baseline":
        raise UserError("--tp applies to the baseline suite (the graph suite's KV probe reads one rank's cache)")
    prefix = prefix_of(out) if out is not None else default_collect_prefix("nano", suite_name, execution)
    overrides: dict[str, Any] = {"tensor_parallel_size": tp}
    if graph_buckets:
        from engine.config import Config

        if "graph_buckets" not in getattr(Config, "__dataclass_fields__", {}):
            raise UserError("this engine has no graph_buckets option")
        overrides["graph_buckets"] = tuple(graph_buckets)
    probe_suite = build_suite(suite_name, seed)
    built = build_engine(model, device, attention, max_num_batched_tokens=probe_suite.budget,
                         max_num_seqs=probe_suite.max_num_seqs, kvcache_block_size=probe_suite.block_size,
                         max_model_len=probe_suite.max_model_len, num_kvcache_blocks=probe_suite.num_kvcache_blocks,
                         enforce_eager=execution == "eager", dtype=dtype, **overrides)
    engine = built.engine
    try:
        suite = build_suite(suite_name, seed, engine.config.vocab_size)
        rows = suite.rows()
        row_at = {(r.group, r.request_index, r.step): r for r in rows}
        vocab = engine.config.vocab_size
        logits = np.zeros((len(rows), vocab), dtype=np.float32)
        got = np.zeros(len(rows), dtype=bool)
        follows = True
        probe = KVProbe() if suite_name == "graph" else None
        buckets = _configured_buckets(engine) if execution == "graph" else None
        step_log: list[dict] = []
        error: str | None = None
        failed_group: str | None = None
        for group in suite.groups:
            fresh_scheduling_state(engine)
            if probe is not None:
                probe.group = group.name

            def on_row(rec: ForcedRecord, group=group) -> None:
                nonlocal follows
                spec = row_at[(group.name, rec.request, rec.output_index)]
                logits[spec.index] = rec.logits.numpy()
                got[spec.index] = True
                follows = follows and tuple(rec.tokens) == spec.tokens
                if progress is not None:
                    progress(1)

            try:
                _, steps = drive_teacher_forced(engine, [r.prompt for r in group.requests],
                                                [r.continuation for r in group.requests], probe=probe, on_row=on_row)
            except Exception as exc:  # noqa: BLE001 - recorded as the finding when a fault is expected
                if not expect_uncovered:
                    raise
                error, failed_group = f"{type(exc).__name__}: {exc}".strip(), group.name
                break
            for st in steps:
                batch = len(st.requests)
                exp_route, exp_bucket = expected_route(execution, st.phase, batch, buckets)
                step_log.append({"group": group.name, "engine_step": st.engine_step, "phase": st.phase,
                                 "batch": batch, "requests": [group.requests[i].label for i in st.requests],
                                 "discarded": [group.requests[i].label for i, c in zip(st.requests, st.completing) if not c],
                                 **st.route, "expected_route": exp_route, "expected_bucket": exp_bucket,
                                 "route_as_expected": st.route["route"] == exp_route and st.route["bucket"] == exp_bucket})
        num_rows = int(got.sum())
        arrays: dict[str, np.ndarray] = {"logits": logits}
        facts: dict[str, Any] = {
            "status": "COLLECTED" if error is None else "INCOMPLETE",
            "suite": suite_name, "seed": seed, "backend": "nano", "execution": execution,
            "tensor_parallel_size": engine.config.tensor_parallel_size,
            "attention": engine.runner.attention_backend, "dtype": str(engine.runner.dtype).replace("torch.", ""),
            "logits_dtype": "float32", "vocab_size": vocab,
            "num_rows": num_rows, "expected_rows": suite.expected_rows,
            "trajectory_sha256": trajectory_sha256(rows), "rows": trajectory(rows),
            "rows_follow_trajectory": follows,
            "requests": suite_requests(suite),
            "groups": [{"name": g.name, "title": g.title, "requests": len(g.requests)} for g in suite.groups],
            "graph_buckets": buckets, "steps": step_log,
            "routes_as_expected": bool(step_log) and all(s["route_as_expected"] for s in step_log),
            "decode_routes": {str(s["batch"]): {k: s[k] for k in ("route", "bucket", "expected_route", "expected_bucket")}
                              for s in step_log if s["phase"] == "decode"},
            "npz": str(_npz_of(prefix)),
            "note": synthetic_note(built.model),
        }
        checks = [
            _check("rows collected", num_rows == suite.expected_rows, suite.expected_rows, num_rows,
                   "one row per accepted output; intermediate chunk candidates are not rows"),
            _check("rows follow the preset trajectory", follows, True, follows,
                   "each row's input is the prompt plus the preset ids before it"),
            _check("logits finite", bool(np.isfinite(logits[got]).all()), True, bool(np.isfinite(logits[got]).all())),
            _check("routes as expected", facts["routes_as_expected"], True, facts["routes_as_expected"],
                   "prefill eager; decode replays the smallest covering graph bucket, else eager"),
        ]
        if probe is not None:
            order = {row_at[key].index: key for key in probe.new_kv}
            kv_rows = sorted(order)
            if kv_rows:
                arrays["kv_new"] = np.stack([probe.new_kv[order[r]] for r in kv_rows])
            arrays["kv_rows"] = np.asarray(kv_rows, dtype=np.int64)
            hist = all(s["history_unchanged"] for s in probe.steps)
            free = all(s["free_blocks_unchanged"] for s in probe.steps)
            facts["kv"] = {"decode_steps": probe.steps, "history_unchanged": hist, "padding_wrote_nothing": free,
                           "new_kv_rows": len(kv_rows),
                           "new_kv_shape": list(arrays["kv_new"].shape) if kv_rows else None}
            checks += [
                _check("history KV unchanged by decode", hist and bool(probe.steps), True, hist,
                       "every cached position of the batch reads back bit-identical after the decode step"),
                _check("padding rows wrote nothing", free and bool(probe.steps), True, free,
                       "unreferenced blocks (incl. block 0 and the last block when free) are bit-identical"),
            ]
        checkpoint = None
        if expect_uncovered:
            checkpoint = CHECKPOINT_UNCOVERED
            s17 = [s for s in step_log if s["phase"] == "decode" and s["batch"] == UNCOVERED_BATCH]
            g17 = f"batch-{UNCOVERED_BATCH}"
            done17 = all(got[r.index] for r in rows if r.group == g17)
            facts["expect_uncovered"] = {
                "buckets": list(graph_buckets or ()), "batch": UNCOVERED_BATCH,
                "route": s17[0]["route"] if s17 else None, "bucket": s17[0]["bucket"] if s17 else None,
                "completed": bool(done17 and s17), "error": error, "failed_group": failed_group,
            }
        arrays_path = save_npz(_npz_of(prefix), arrays)
        facts["npz_arrays"] = {k: list(v.shape) for k, v in arrays.items()}
        engine_info = {**built.describe(), "execution": execution, "graph_buckets": buckets,
                       "capture_seconds": round(float(getattr(engine.runner, "capture_seconds", 0.0) or 0.0), 4)}
        record = write_evidence(_json_of(prefix), checkpoint=checkpoint, kind=built.kind, facts=facts,
                                device=built.device, model=built.model, seed=seed, engine=engine_info,
                                extra_checks=checks)
        record["_paths"] = {"json": str(_json_of(prefix)), "npz": str(arrays_path)}
        return record
    finally:
        engine.close()
        del engine, built
        _free_torch(device)


# =========================================================================== collect: hf


def hf_dtype(device: str, dtype: str = "auto"):
    import torch

    if dtype == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if dtype not in DTYPE_CHOICES:
        raise UserError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    return getattr(torch, dtype)


def load_reference_model(path: str | Path, device: str, dtype: str = "auto"):
    """transformers' causal LM on ``path``: eager attention, BF16 on CUDA / float32 on CPU (auto), eval mode."""
    import transformers
    from transformers import AutoModelForCausalLM

    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager",
                                                     dtype=hf_dtype(device, dtype))
    except (OSError, ValueError) as exc:
        raise UserError(f"transformers cannot load {path}: {' '.join(str(exc).split())[:200]}") from None
    return model.to(device).eval()


def reference_last_logits(model, tokens, device: str):
    """Logits of the last position, recomputing the whole prefix (use_cache=False, positions 0..n-1)."""
    import torch

    ids = torch.tensor([list(tokens)], dtype=torch.long, device=device)
    pos = torch.arange(ids.shape[1], device=device)[None]
    with torch.no_grad():
        out = model(input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=1)
    return out.logits[0, -1].float().cpu()


def collect_hf(suite_name: str, out: str | Path | None = None, *, model: str | None = None, device: str = "auto",
               dtype: str = "auto", seed: int = DEFAULT_SEED, progress: Callable[[int], None] | None = None) -> dict:
    """The reference rows: transformers recomputes each row's whole prefix. Writes PREFIX.json/.npz."""
    import transformers

    from labkit.experiments.common import detect_device, synthetic_note
    from labkit.assets.identity import model_identity
    from labkit.assets.resolve import resolve_model

    _validate_choices(suite_name, "hf", "eager", "auto", dtype)
    device = detect_device(device)
    prefix = prefix_of(out) if out is not None else default_collect_prefix("hf", suite_name, "eager")
    ref = resolve_model(model, device)
    identity = dict(model_identity(ref.path))
    identity["source"] = ref.source
    hf = load_reference_model(ref.path, device, dtype)
    try:
        vocab = int(hf.config.vocab_size)
        suite = build_suite(suite_name, seed, vocab)
        rows = suite.rows()
        logits = np.zeros((len(rows), vocab), dtype=np.float32)
        for r in rows:
            logits[r.index] = reference_last_logits(hf, r.tokens, device).numpy()
            if progress is not None:
                progress(1)
        dtype = str(hf_dtype(device, dtype)).replace("torch.", "")
        facts = {
            "status": "COLLECTED", "suite": suite_name, "seed": seed, "backend": "hf", "execution": "eager",
            "attention": "eager", "dtype": dtype, "logits_dtype": "float32", "vocab_size": vocab,
            "num_rows": len(rows), "expected_rows": suite.expected_rows,
            "trajectory_sha256": trajectory_sha256(rows), "rows": trajectory(rows),
            "rows_follow_trajectory": True, "requests": suite_requests(suite),
            "groups": [{"name": g.name, "title": g.title, "requests": len(g.requests)} for g in suite.groups],
            "steps": [{"row": r.id, "phase": r.phase, "width": len(r.tokens), "backend": "hf-eager", "route": "eager",
                       "bucket": None} for r in rows],
            "npz": str(_npz_of(prefix)), "note": synthetic_note(identity),
        }
        finite = bool(np.isfinite(logits).all())
        checks = [_check("rows collected", len(rows) == suite.expected_rows, suite.expected_rows, len(rows)),
                  _check("logits finite", finite, True, finite)]
        path = save_npz(_npz_of(prefix), {"logits": logits})
        facts["npz_arrays"] = {"logits": list(logits.shape)}
        engine_info = {"implementation": "transformers", "version": transformers.__version__,
                       "class": type(hf).__name__, "attn_implementation": "eager", "use_cache": False,
                       "position_ids": "0..n-1", "dtype": dtype, "device": device}
        kind = "gpu-measured" if device.startswith("cuda") else "cpu-real-engine"
        record = write_evidence(_json_of(prefix), checkpoint=None, kind=kind, facts=facts, device=device,
                                model=identity, seed=seed, engine=engine_info, extra_checks=checks)
        record["_paths"] = {"json": str(_json_of(prefix)), "npz": str(path)}
        return record
    finally:
        del hf
        _free_torch(device)


def _validate_choices(suite: str, backend: str, execution: str, attention: str, dtype: str = "auto") -> None:
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


def collect(backend: str, suite: str, out: str | Path | None = None, *, model: str | None = None,
            device: str = "auto", attention: str = "auto", execution: str = "eager",
            graph_buckets: tuple[int, ...] | None = None, expect_uncovered: bool = False, seed: int = DEFAULT_SEED,
            dtype: str = "auto", progress: Callable[[int], None] | None = None, tp: int = 1) -> dict:
    """``labkit logits collect``: dispatch to the nano or hf collector."""
    _validate_choices(suite, backend, execution, attention, dtype)
    if backend == "hf":
        if execution != "eager" or attention != "auto" or graph_buckets or expect_uncovered or tp != 1:
            raise UserError("--backend hf takes no --execution/--attention/--graph-buckets/--expect-uncovered "
                            "(it is transformers with eager attention)")
        return collect_hf(suite, out, model=model, device=device, dtype=dtype, seed=seed, progress=progress)
    return collect_nano(suite, out, model=model, device=device, attention=attention, execution=execution,
                        graph_buckets=graph_buckets, expect_uncovered=expect_uncovered, seed=seed, dtype=dtype, tp=tp,
                        progress=progress)


# =========================================================================== compare


@dataclass
class Collection:
    prefix: Path
    record: dict
    logits: np.ndarray
    kv_new: np.ndarray | None
    kv_rows: np.ndarray | None

    @property
    def facts(self) -> dict:
        return self.record.get("facts") or {}

    def label(self) -> str:
        f = self.facts
        if f.get("backend") == "hf":
            return "hf"
        return f"nano/{f.get('execution')}/{f.get('attention')}"

    def summary(self) -> dict:
        f, r = self.facts, self.record
        out = {"prefix": str(self.prefix), "backend": f.get("backend"), "execution": f.get("execution"),
               "attention": f.get("attention"), "dtype": f.get("dtype"), "device": r.get("device"),
               "kind": r.get("kind"), "verdict": r.get("verdict"), "num_rows": f.get("num_rows"),
               "engine_source_hash": r.get("engine_source_hash")}
        if f.get("backend") == "nano":
            out["tensor_parallel_size"] = f.get("tensor_parallel_size", 1)
            out["routes_as_expected"] = f.get("routes_as_expected")
            out["decode_routes"] = f.get("decode_routes")
        if "kv" in f:
            out["history_unchanged"] = f["kv"].get("history_unchanged")
            out["padding_wrote_nothing"] = f["kv"].get("padding_wrote_nothing")
        return out


def load_collection(path: str | Path, side: str = "") -> Collection:
    prefix = prefix_of(path)
    jpath, npath = _json_of(prefix), _npz_of(prefix)
    where = f"--{side} " if side else ""
    for p in (jpath, npath):
        if not p.is_file():
            raise UserError(f"{where}{prefix}: {p.name} not found (run `labkit logits collect --out {prefix}` first)")
    try:
        record = read_json(jpath)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{where}{jpath}: unreadable JSON ({exc})") from None
    facts = record.get("facts") if isinstance(record, dict) else None
    if not isinstance(facts, dict) or "trajectory_sha256" not in facts or "rows" not in facts:
        raise UserError(f"{where}{jpath} is not a `labkit logits collect` file")
    try:
        with np.load(npath) as z:
            logits = np.asarray(z["logits"], dtype=np.float32)
            kv_new = np.asarray(z["kv_new"], dtype=np.float32) if "kv_new" in z.files else None
            kv_rows = np.asarray(z["kv_rows"], dtype=np.int64) if "kv_rows" in z.files else None
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{where}{npath}: unreadable arrays ({' '.join(str(exc).split())[:160]})") from None
    if logits.ndim != 2 or logits.shape[0] != len(facts["rows"]):
        raise UserError(f"{where}{npath}: logits shape {list(logits.shape)} does not match the "
                        f"{len(facts['rows'])} rows of {jpath.name}")
    return Collection(prefix, record, logits, kv_new, kv_rows)


def _refuse_mismatch(lhs: Collection, rhs: Collection) -> None:
    lf, rf = lhs.facts, rhs.facts
    if lf.get("suite") != rf.get("suite"):
        raise UserError(f"refusing to compare: suites differ (lhs {lf.get('suite')}, rhs {rf.get('suite')})")
    lm, rm = lhs.record.get("model") or {}, rhs.record.get("model") or {}
    for key in ("config_sha256", "weights_sha256"):
        if not lm.get(key) or lm.get(key) != rm.get(key):
            raise UserError(f"refusing to compare: model {key.split('_')[0]} sha256 differs "
                            f"(lhs {str(lm.get(key))[:12]}, rhs {str(rm.get(key))[:12]})")
    lrows, rrows = lf["rows"], rf["rows"]
    if lf["trajectory_sha256"] != rf["trajectory_sha256"] or len(lrows) != len(rrows):
        for a, b in zip(lrows, rrows):
            if (a.get("id"), a.get("tokens_sha256")) != (b.get("id"), b.get("tokens_sha256")):
                raise UserError(f"refusing to compare: trajectories differ at row {a.get('index')} "
                                f"(lhs {a.get('id')} len {a.get('length')}, rhs {b.get('id')} len {b.get('length')})")
        raise UserError(f"refusing to compare: trajectories differ (lhs {len(lrows)} rows, rhs {len(rrows)} rows; "
                        f"seed {lf.get('seed')} vs {rf.get('seed')})")
    if lhs.logits.shape != rhs.logits.shape:
        raise UserError(f"refusing to compare: logits shapes differ ({list(lhs.logits.shape)} vs {list(rhs.logits.shape)})")


def row_metrics(a: np.ndarray, b: np.ndarray) -> dict:
    """a measured, b reference (1-D): max abs, relative L2, top-1 of each, reference top-2 margin."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    diff = a64 - b64
    norm_b = float(np.linalg.norm(b64))
    top2 = np.argpartition(-b64, 1)[:2]
    top2 = top2[np.argsort(-b64[top2])]
    return {"max_abs": float(np.max(np.abs(diff))),
            "rel_l2": float(np.linalg.norm(diff) / norm_b) if norm_b > 0 else float(np.linalg.norm(diff)),
            "top1_lhs": int(np.argmax(a64)), "top1_rhs": int(top2[0]),
            "ref_margin": float(b64[top2[0]] - b64[top2[1]])}


def judge_rows(metrics: list[dict], max_abs: float, rel_l2: float) -> tuple[str, list[dict]]:
    """Mark each row's failures; verdict PASS (none), REVIEW (only explained top-1 flips) or FAIL.

    A top-1 flip is explained when the reference's top-2 margin is smaller than the row's measured max
    abs error: an error of that size can reorder two candidates that close.
    """
    explained_only = True
    any_fail = False
    for m in metrics:
        reasons = []
        if not (m["max_abs"] <= max_abs):
            reasons.append("max_abs")
        if not (m["rel_l2"] <= rel_l2):
            reasons.append("rel_l2")
        if m.get("kv_ok") is False:
            reasons.append("kv")
        m["top1_same"] = m["top1_lhs"] == m["top1_rhs"]
        m["flip_explained"] = (not m["top1_same"]) and m["ref_margin"] < m["max_abs"]
        if not m["top1_same"]:
            reasons.append("top1_flip" if m["flip_explained"] else "top1")
        m["failures"] = reasons
        if reasons:
            any_fail = True
            if reasons != ["top1_flip"]:
                explained_only = False
    if not any_fail:
        return "PASS", metrics
    return ("REVIEW" if explained_only else "FAIL"), metrics


def _compare_checkpoint(lhs: Collection, rhs: Collection) -> str | None:
    lf, rf = lhs.facts, rhs.facts
    if lf.get("suite") == "baseline" and lf.get("backend") == "nano" and rf.get("backend") == "hf":
        return CHECKPOINT_BASELINE
    if (lf.get("suite") == "graph" and lf.get("backend") == "nano" and lf.get("execution") == "graph"
            and rf.get("backend") == "nano" and rf.get("execution") == "eager"):
        return CHECKPOINT_GRAPH
    return None


def default_compare_out(lhs: str | Path, rhs: str | Path) -> Path:
    """The checkpoint's evidence path when the pair is a known guardrail, else runs/logits-compare.json."""
    try:
        cp = _compare_checkpoint(load_collection(lhs, "lhs"), load_collection(rhs, "rhs"))
    except UserError:
        cp = None
    if cp is not None:
        from labkit.checks import get_checkpoint

        return get_checkpoint(cp).evidence_path()
    return default_out("logits-compare.json")


def _row_brief(spec: dict, m: dict) -> dict:
    return {"index": spec["index"], "id": spec["id"], "phase": spec["phase"], "length": spec["length"],
            "max_abs": m["max_abs"], "rel_l2": m["rel_l2"], "top1_lhs": m["top1_lhs"], "top1_rhs": m["top1_rhs"],
            "ref_margin": m["ref_margin"], **({"kv_max_abs": m["kv_max_abs"], "kv_rel_l2": m["kv_rel_l2"]}
                                              if "kv_max_abs" in m else {}),
            "failures": m.get("failures", [])}


def compare(lhs_path: str | Path, rhs_path: str | Path, out: str | Path | None = None, *,
            max_abs: float = DEFAULT_MAX_ABS, rel_l2: float = DEFAULT_REL_L2,
            kv_max_abs: float = DEFAULT_KV_MAX_ABS, checkpoint: str | None = "auto", worst: int = 5) -> dict:
    """``labkit logits compare``: lhs is measured, rhs the reference. Writes the evidence JSON."""
    for name, v in (("--max-abs", max_abs), ("--rel-l2", rel_l2), ("--kv-max-abs", kv_max_abs)):
        if not (isinstance(v, (int, float)) and v >= 0 and np.isfinite(v)):
            raise UserError(f"{name} must be a finite number >= 0, got {v!r}")
    lhs, rhs = load_collection(lhs_path, "lhs"), load_collection(rhs_path, "rhs")
    _refuse_mismatch(lhs, rhs)
    specs = lhs.facts["rows"]
    metrics = [row_metrics(lhs.logits[i], rhs.logits[i]) for i in range(len(specs))]
    kv_compared = (lhs.kv_new is not None and rhs.kv_new is not None and lhs.kv_rows is not None
                   and rhs.kv_rows is not None and np.array_equal(lhs.kv_rows, rhs.kv_rows)
                   and lhs.kv_new.shape == rhs.kv_new.shape)
    kv_summary: dict[str, Any] = {"compared": bool(kv_compared), "max_abs_threshold": kv_max_abs,
                                  "rel_l2_threshold": rel_l2}
    if kv_compared:
        kv_max, kv_rel = [], []
        for j, r in enumerate(lhs.kv_rows.tolist()):
            a, b = lhs.kv_new[j].astype(np.float64), rhs.kv_new[j].astype(np.float64)
            d = a - b
            nb = float(np.linalg.norm(b))
            m = metrics[r]
            m["kv_max_abs"] = float(np.max(np.abs(d)))
            m["kv_rel_l2"] = float(np.linalg.norm(d) / nb) if nb > 0 else float(np.linalg.norm(d))
            m["kv_ok"] = m["kv_max_abs"] <= kv_max_abs and m["kv_rel_l2"] <= rel_l2
            kv_max.append(m["kv_max_abs"])
            kv_rel.append(m["kv_rel_l2"])
        kv_summary.update({"rows": len(kv_max), "worst_max_abs": max(kv_max, default=0.0),
                           "worst_rel_l2": max(kv_rel, default=0.0),
                           "rows_within": sum(1 for r in lhs.kv_rows.tolist() if metrics[r]["kv_ok"])})
    else:
        have = [s for s, c in (("lhs", lhs), ("rhs", rhs)) if c.kv_new is not None]
        kv_summary["why_not"] = ("neither side has new-KV arrays" if not have else
                                 f"only {have[0]} has new-KV arrays" if len(have) == 1 else "new-KV rows differ")
    verdict, metrics = judge_rows(metrics, max_abs, rel_l2)
    failing = [i for i, m in enumerate(metrics) if m["failures"]]
    first = _row_brief(specs[failing[0]], metrics[failing[0]]) if failing else None
    by_abs = sorted(range(len(metrics)), key=lambda i: (-metrics[i]["max_abs"], i))[:worst]
    max_abs_all = [m["max_abs"] for m in metrics]
    rel_all = [m["rel_l2"] for m in metrics]
    flips = [i for i, m in enumerate(metrics) if not m["top1_same"]]
    unexplained = [i for i in flips if not metrics[i]["flip_explained"]]
    facts = {
        "suite": lhs.facts.get("suite"), "seed": lhs.facts.get("seed"),
        "lhs": lhs.summary(), "rhs": rhs.summary(),
        "thresholds": {"max_abs": max_abs, "rel_l2": rel_l2, "kv_max_abs": kv_max_abs},
        "trajectory_sha256": lhs.facts["trajectory_sha256"], "trajectory_match": True, "model_match": True,
        "num_rows": len(metrics),
        "worst_max_abs": max(max_abs_all), "worst_rel_l2": max(rel_all),
        "median_max_abs": float(np.median(max_abs_all)), "median_rel_l2": float(np.median(rel_all)),
        "rows_within_max_abs": sum(1 for v in max_abs_all if v <= max_abs),
        "rows_within_rel_l2": sum(1 for v in rel_all if v <= rel_l2),
        "top1_agree": len(metrics) - len(flips), "top1_flips": len(flips), "unexplained_top1_flips": len(unexplained),
        "failing_rows": len(failing),
        "first_divergent_row": first,
        "worst_rows": [_row_brief(specs[i], metrics[i]) for i in by_abs],
        "kv": kv_summary,
        "comparison_verdict": verdict,
        "rows": [[specs[i]["id"], round(m["max_abs"], 9), round(m["rel_l2"], 9), m["top1_same"], round(m["ref_margin"], 6)]
                 for i, m in enumerate(metrics)],
        "rows_columns": ["id", "max_abs", "rel_l2", "top1_same", "ref_margin"],
    }
    flip_status = "pass" if not flips else ("review" if not unexplained else "fail")
    checks = [
        _check("same trajectory and model", True, "identical", "identical",
               "both files hold the same rows, input tokens and model sha256"),
        _check("rows within max abs", facts["rows_within_max_abs"] == len(metrics), f"<= {max_abs}",
               facts["worst_max_abs"], f"worst row max abs error; first divergent row: {first['id'] if first else 'none'}"),
        _check("rows within relative L2", facts["rows_within_rel_l2"] == len(metrics), f"<= {rel_l2}",
               facts["worst_rel_l2"], "||lhs - rhs|| / ||rhs||"),
        _check("top-1 agreement", not flips, len(metrics), facts["top1_agree"],
               "a flip whose reference top-2 margin is below that row's max abs error asks for review",
               status=flip_status),
    ]
    if kv_compared:
        ok = kv_summary["rows_within"] == kv_summary["rows"]
        checks.append(_check("new KV within thresholds", ok, f"max abs <= {kv_max_abs}, rel L2 <= {rel_l2}",
                             {"worst_max_abs": kv_summary["worst_max_abs"], "worst_rel_l2": kv_summary["worst_rel_l2"]},
                             "K/V written at each decode row's new position, every layer"))
    for side, c in (("lhs", lhs), ("rhs", rhs)):
        v = c.record.get("verdict")
        checks.append(_check(f"{side} collection checks", v != "FAIL", "not FAIL", v,
                             "rows complete, routes as expected, history KV and padding untouched"))
    cp = _compare_checkpoint(lhs, rhs) if checkpoint == "auto" else checkpoint
    out_path = Path(out) if out is not None else default_compare_out(lhs_path, rhs_path)
    kind = lhs.record.get("kind") or "cpu-real-engine"
    if not str(lhs.record.get("device") or "").startswith("cuda"):
        kind = "cpu-real-engine"
    record = write_evidence(out_path, checkpoint=cp, kind=kind, facts=facts, device=lhs.record.get("device"),
                            model=lhs.record.get("model"), seed=lhs.facts.get("seed"),
                            engine={"lhs": lhs.record.get("engine"), "rhs": rhs.record.get("engine")},
                            extra_checks=checks)
    record["_paths"] = {"json": str(out_path)}
    return record


# =========================================================================== guard: one command, both sides


def guard(suite: str, out: str | Path | None = None, *, model: str | None = None, device: str = "auto",
          attention: str = "auto", graph_buckets: tuple[int, ...] | None = None, seed: int = DEFAULT_SEED,
          dtype: str = "auto", max_abs: float = DEFAULT_MAX_ABS, rel_l2: float = DEFAULT_REL_L2, kv_max_abs: float = DEFAULT_KV_MAX_ABS,
          lhs_out: str | Path | None = None, rhs_out: str | Path | None = None,
          progress: Callable[[str, int], Callable[[int], None]] | None = None, tp: int = 1) -> dict:
    """Collect a suite's guardrail pair and compare it (the checkpoint's one command).

    baseline: nano eager (lhs, ``tp`` ranks) against hf (rhs). graph: nano graph (lhs) against nano eager (rhs).
    """
    from labkit.checks import get_checkpoint
    from labkit.experiments.common import detect_device

    _validate_choices(suite, "nano", "eager", attention, dtype)
    device = detect_device(device)
    if suite == "graph" and not device.startswith("cuda"):
        raise UserError("graph execution needs CUDA")
    if tp > 1 and suite != "baseline":
        raise UserError("--tp applies to the baseline suite")
    cp = CHECKPOINT_BASELINE if suite == "baseline" else CHECKPOINT_GRAPH
    if tp > 1:
        cp = CHECKPOINT_TP_GPU if device.startswith("cuda") else CHECKPOINT_TP_CPU
    out_path = Path(out) if out is not None else get_checkpoint(cp).evidence_path()
    names = ("engine-nano", "engine-hf") if suite == "baseline" else ("graph-patched", "graph-eager")
    if tp > 1:
        names = (f"engine-nano-tp{tp}", "engine-hf")
    lhs_p = prefix_of(lhs_out) if lhs_out else out_path.parent / names[0]
    rhs_p = prefix_of(rhs_out) if rhs_out else out_path.parent / names[1]
    rows = build_suite(suite, seed).expected_rows

    def tick(label: str) -> Callable[[int], None] | None:
        return progress(label, rows) if progress is not None else None

    if suite == "baseline":
        collect_nano(suite, lhs_p, model=model, device=device, attention=attention, execution="eager", seed=seed,
                     dtype=dtype, progress=tick("nano eager"), tp=tp)
        collect_hf(suite, rhs_p, model=model, device=device, dtype=dtype, seed=seed, progress=tick("hf"))
    else:
        collect_nano(suite, lhs_p, model=model, device=device, attention=attention, execution="graph",
                     graph_buckets=graph_buckets, seed=seed, dtype=dtype, progress=tick("nano graph"))
        collect_nano(suite, rhs_p, model=model, device=device, attention=attention, execution="eager", seed=seed,
                     dtype=dtype, progress=tick("nano eager"))
    return compare(lhs_p, rhs_p, out_path, max_abs=max_abs, rel_l2=rel_l2, kv_max_abs=kv_max_abs, checkpoint=cp)


def calibrate(suites: tuple[str, ...] = ("baseline", "graph"), backends: tuple[str, ...] | None = None,
              dtypes: tuple[str, ...] = ("auto",), repeats: int = 3, out: str | Path | None = None, *,
              model: str | None = None, device: str = "auto", seed: int = DEFAULT_SEED,
              work_dir: str | Path | None = None) -> dict:
    """Error distributions of the engine against transformers (issue: calibrate the thresholds).

    For every suite, dtype and attention backend available here, ``repeats`` engine collections are each
    compared with one transformers collection of the same suite and dtype. On CUDA the graph suite runs
    with graph execution. Only the per-comparison summaries are kept (the NPZ arrays are deleted).
    """
    import shutil
    import statistics

    from engine.attention import available_backends
    from labkit.evidence import default_out, write_evidence
    from labkit.experiments.common import detect_device
    from labkit.assets.identity import model_identity
    from labkit.assets.resolve import resolve_model

    if repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {repeats}")
    device = detect_device(device)
    backends = tuple(backends or available_backends(device))
    for suite in suites:
        for backend in backends:
            for dtype in dtypes:
                _validate_choices(suite, "nano", "eager", backend, dtype)
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="labkit-calibrate-"))
    work.mkdir(parents=True, exist_ok=True)
    results = []
    try:
        for suite in suites:
            execution = "graph" if suite == "graph" and device.startswith("cuda") else "eager"
            for dtype in dtypes:
                ref = work / f"hf-{suite}-{dtype}"
                collect_hf(suite, ref, model=model, device=device, dtype=dtype, seed=seed)
                for backend in backends:
                    runs = []
                    for r in range(repeats):
                        lhs = work / f"nano-{suite}-{dtype}-{backend}-{r}"
                        collect_nano(suite, lhs, model=model, device=device, attention=backend, execution=execution,
                                     seed=seed, dtype=dtype)
                        f = compare(lhs, ref, work / f"cmp-{suite}-{dtype}-{backend}-{r}.json", checkpoint=None)["facts"]
                        runs.append({k: f[k] for k in ("worst_max_abs", "median_max_abs", "worst_rel_l2",
                                                        "median_rel_l2", "top1_agree", "num_rows")}
                                    | {"verdict": f["comparison_verdict"]})
                        lhs.with_suffix(".npz").unlink(missing_ok=True)
                    results.append({
                        "suite": suite, "execution": execution, "dtype": dtype, "backend": backend, "repeats": runs,
                        "worst_max_abs": max(x["worst_max_abs"] for x in runs),
                        "median_max_abs": statistics.median(x["median_max_abs"] for x in runs),
                        "worst_rel_l2": max(x["worst_rel_l2"] for x in runs),
                        "median_rel_l2": statistics.median(x["median_rel_l2"] for x in runs),
                        "min_top1_agree": min(x["top1_agree"] for x in runs),
                        "num_rows": runs[0]["num_rows"],
                        "repeat_spread_max_abs": max(x["worst_max_abs"] for x in runs) - min(x["worst_max_abs"] for x in runs),
                    })
    finally:
        if work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    ref_model = resolve_model(model, device)
    facts = {"device": device, "suites": list(suites), "dtypes": list(dtypes), "backends": list(backends),
             "repeats": repeats, "seed": seed, "results": results}
    return write_evidence(out or default_out("logits-calibration.json"), checkpoint=None,
                          kind="gpu-measured" if device.startswith("cuda") else "cpu-real-engine", facts=facts,
                          device=device, model=dict(model_identity(ref_model.path)), seed=seed)
