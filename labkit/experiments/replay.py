"""``labkit course replay``: the CUDA-graph replay rule of lesson 8 applied on a CPU, by the engine's own code.

For each batch size and phase, real step inputs are built (``InputBuilder.plan_decode`` / ``plan_prefill`` on
real sequences, then ``to_inputs``) and handed to ``ModelRunner.route_for``, the function every step calls to
pick eager, a decode graph or a prefill graph. The runner it is called on is a stand-in that holds real
``DecodeGraphs`` / ``PrefillGraphs`` objects whose buckets are marked captured (a CPU cannot capture a CUDA
graph; which bucket a batch takes is their ``bucket_for``, unchanged). Each row sets the engine's route beside
the course's ``will_replay`` rule and its bucket choice (``next(x for x in graph_bs if x >= bs)``), computed
independently below (:func:`course_will_replay`, :func:`course_bucket`).
"""
from __future__ import annotations

from pathlib import Path
from labkit.errors import UserError
from labkit.evidence import write_claimed

DEFAULT_BATCHES = (1, 3, 8, 100, 128, 512, 513)
DEFAULT_MAX_NUM_SEQS = 512


# --------------------------------------------------------------------------- the course's rule (lesson 8)


def course_will_replay(is_prefill: bool, enforce_eager: bool, batch_size: int, largest_bucket: int = 512) -> bool:
    """Lesson 8's rule; nano-vllm's 512 is its largest captured batch (ours: the largest bucket)."""
    return not (is_prefill or enforce_eager or batch_size > largest_bucket)


def course_bucket(batch_size: int, buckets: list[int]) -> int | None:
    return next((b for b in sorted(buckets) if b >= batch_size), None)


# --------------------------------------------------------------------------- the engine's rule


def _captured(graphs, buckets: list[int]):
    """A graph set whose buckets count as captured (CUDA graphs cannot be captured on a CPU)."""
    graphs.graphs = dict.fromkeys(buckets)
    return graphs


class StandInRunner:
    """What ModelRunner.route_for reads of its runner: its graph sets. Those given are set; any other
    attribute (a graph kind not asked for here) reads None: not captured."""

    def __init__(self, **graphs):
        self.__dict__.update(graphs)

    def __getattr__(self, name: str):
        return None


def stand_in_runner(buckets: list[int] | None, prefill_buckets: list[int] | None, enforce_eager: bool):
    """The decode graphs (None when eager is enforced, as the engine never captures them then) and the
    prefill graphs (None unless buckets are given)."""
    from engine.graph import PREFILL_GRAPH_SEQS, DecodeGraphs, PrefillGraphs

    graphs = prefill = None
    if not enforce_eager and buckets:
        graphs = _captured(DecodeGraphs(None, buckets, 1, 16, "cpu"), buckets)
        if prefill_buckets:
            prefill = _captured(PrefillGraphs(None, prefill_buckets, PREFILL_GRAPH_SEQS, "cpu"), prefill_buckets)
    return StandInRunner(graphs=graphs, prefill_graphs=prefill)


def step_inputs(phase: str, batch: int, block_size: int = 16):
    """Real StepInputs of a decode of `batch` sequences, or a fresh prefill of `batch` tokens (one sequence)."""
    from engine import SamplingParams
    from engine.sequence import Sequence
    from engine.step_inputs import InputBuilder

    builder = InputBuilder(block_size, "cpu")
    if phase == "decode":
        seqs = []
        for i in range(batch):
            s = Sequence(i, [1, 2], SamplingParams(), block_size)
            s.block_table = [i]
            s.num_cached_tokens, s.num_scheduled_tokens = 1, 1
            seqs.append(s)
        return builder.to_inputs(builder.plan_decode(seqs))
    s = Sequence(0, [1] * batch, SamplingParams(), block_size)
    s.block_table = list(range((batch + block_size - 1) // block_size))
    s.num_scheduled_tokens = batch
    return builder.to_inputs(builder.plan_prefill([s]))


def replay_rows(batches: list[int], buckets: list[int] | None, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                phases: tuple[str, ...] = ("prefill", "decode"), enforce_eager: bool = False,
                prefill_buckets: list[int] | None = None) -> list[dict]:
    from engine import ModelRunner
    from engine.graph import default_buckets

    if any(b < 1 for b in batches):
        raise UserError("--batch-sizes: every batch size must be at least 1")
    buckets = sorted(set(buckets)) if buckets else default_buckets(max_num_seqs)
    runner = stand_in_runner(buckets, prefill_buckets, enforce_eager)
    rows = []
    for phase in phases:
        for batch in batches:
            route = ModelRunner.route_for(runner, step_inputs(phase, batch))
            replay = course_will_replay(phase == "prefill", enforce_eager, batch, buckets[-1])
            want_bucket = course_bucket(batch, buckets) if replay else None
            if phase == "decode":
                agree = (route.kind == "graph") == replay and (route.bucket if route.kind == "graph" else None) == want_bucket
            else:       # the course: a prefill never replays; ours may replay a prefill graph (small, fresh)
                agree = route.kind != "graph" and (route.kind == "eager" or bool(prefill_buckets))
            rows.append({"phase": phase, "batch": batch, "route": str(route), "kind": route.kind,
                         "bucket": route.bucket, "course_will_replay": replay, "course_bucket": want_bucket,
                         "agree": agree})
    return rows


def replay_facts(batches: list[int], buckets: list[int] | None, max_num_seqs: int, enforce_eager: bool,
                 prefill_buckets: list[int] | None = None) -> dict:
    from engine.graph import default_buckets

    rows = replay_rows(batches, buckets, max_num_seqs, enforce_eager=enforce_eager, prefill_buckets=prefill_buckets)
    used = sorted(set(buckets)) if buckets else default_buckets(max_num_seqs)
    return {
        "rule": "ModelRunner.route_for(inputs): a decode replays DecodeGraphs.bucket_for(batch) (the smallest "
                "captured bucket >= batch), a fresh prefill PrefillGraphs.bucket_for(tokens, seqs) when prefill "
                "graphs exist, anything else is eager",
        "stand_in": "the runner's graphs are real DecodeGraphs/PrefillGraphs objects with their buckets marked "
                    "captured (a CPU cannot capture CUDA graphs); route_for and bucket_for run unchanged",
        "batch_sizes": list(batches), "buckets": used, "largest_bucket": used[-1],
        "prefill_buckets": sorted(prefill_buckets) if prefill_buckets else [],
        "enforce_eager": enforce_eager, "max_num_seqs": max_num_seqs,
        "rows": rows,
        "replayed": [r["batch"] for r in rows if r["kind"] == "graph"],
        "eager": [[r["phase"], r["batch"]] for r in rows if r["kind"] == "eager"],
        "all_agree": bool(rows) and all(r["agree"] for r in rows),
        "disagree": [r for r in rows if not r["agree"]],
    }


def run_replay(out: Path | None, batches: list[int], buckets: list[int] | None, max_num_seqs: int,
               enforce_eager: bool, prefill_buckets: list[int] | None = None) -> dict:
    facts = replay_facts(batches, buckets, max_num_seqs, enforce_eager, prefill_buckets)
    default = (tuple(batches) == DEFAULT_BATCHES and not buckets and max_num_seqs == DEFAULT_MAX_NUM_SEQS
               and not enforce_eager and not prefill_buckets)
    return write_claimed("course.replay" if default else None, out, "course-replay.json",
                         unclaimed_name="course-replay-custom.json", kind="cpu-real-scheduler", facts=facts,
                         device="cpu")
