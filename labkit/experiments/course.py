"""``labkit course ex N`` and ``labkit course show N``: the companion course's exercises on this engine.

Each lesson of the course (docs/COURSE.md) ends with a small exercise written against nano-vllm. Here each is
translated to this engine's API and run on the real code (the real ``Sequence``, ``Scheduler``,
``BlockManager``, ``InputBuilder``, attention backend, ``LLM`` and ``ModelRunner.route_for``), and judged
against the course's expected output, computed by the course's own rule (:data:`COURSE_RULES`: a plain
restatement of what the lesson's snippet computes, never a copy of our code). The facts say what the course
expects, what the engine gave, and whether they agree; the checkpoint ``course.ex-N`` asserts that.

``labkit course show N`` prints lesson N's functions of ours (the ``- ours:`` anchors of docs/COURSE.md) with
the ``file:line`` where each is defined, read from the source when it runs; with ``--source`` it also writes their
source, numbered as the files are, to ``runs/course-lesson-N-source.txt`` (the handbook's source walk).
"""
from __future__ import annotations

import re
from pathlib import Path

from labkit.errors import UserError
from labkit.evidence import write_claimed
from labkit.paths import definition_line, definition_span

LESSONS = range(1, 9)
ANCHOR = re.compile(r"`([\w./-]+\.py)(?::([\w.]+))?`")
LESSON_HEAD = re.compile(r"^## Lesson (\d+):(.*)$", re.M)


def check_lesson(n: int) -> int:
    if n not in LESSONS:
        raise UserError(f"lesson {n}: the course has lessons 1 to 8")
    return n


# --------------------------------------------------------------------------- course show


def course_doc() -> Path:
    from labkit.paths import repo_root

    return repo_root() / "docs" / "COURSE.md"


def lesson_functions(n: int, doc: Path | None = None) -> dict:
    """Lesson n's title and each of its ``- ours:`` anchors as {anchor, file, name, line} (line None when the
    name is not defined there: docs/COURSE.md and the code disagree)."""
    check_lesson(n)
    doc = doc or course_doc()
    text = doc.read_text(encoding="utf-8")
    heads = list(LESSON_HEAD.finditer(text))
    head = next((h for h in heads if int(h.group(1)) == n), None)
    if head is None:
        raise UserError(f"{doc}: no section '## Lesson {n}:'")
    end = next((h.start() for h in heads if h.start() > head.start()), len(text))
    root = doc.parent.parent
    rows = []
    for line in text[head.start():end].splitlines():
        if not line.lstrip().startswith("- ours:"):
            continue
        for m in ANCHOR.finditer(line):
            path, name = m.group(1), m.group(2)
            file = root / path
            rows.append({"anchor": f"{path}:{name}" if name else path, "file": path, "name": name,
                         "line": definition_line(file, name) if file.is_file() else None})
    return {"lesson": n, "title": head.group(2).strip(), "functions": rows}


def lesson_source(got: dict, doc: Path | None = None) -> str:
    """A lesson's functions (``got``: :func:`lesson_functions` of ``doc``) as one text: a header per function
    (``file:first-last`` and its name) and its source lines, decorators included, each numbered as in the file, so
    a line read here is a breakpoint there (``b engine/scheduler.py:NN``)."""
    n = got["lesson"]
    root = (doc or course_doc()).parent.parent
    out = [f"# lesson {n}: {got['title']}", "# this engine's functions for the lesson (docs/COURSE.md's `- ours:` "
           "anchors), read from the source by `labkit course show " f"{n} --source`", ""]
    for f in got["functions"]:
        file = root / f["file"]
        span = definition_span(file, f["name"]) if file.is_file() else None
        if span is None:
            raise UserError(f"docs/COURSE.md names what the code does not define: {f['anchor']}")
        lines = file.read_text(encoding="utf-8").splitlines()[span[0] - 1:span[1]]
        out.append(f"## {f['file']}:{span[0]}-{span[1]}  {f['name'] or '(the file)'}")
        out += [f"{i:5d}  {line}".rstrip() for i, line in enumerate(lines, span[0])]
        out.append("")
    return "\n".join(out)


# --------------------------------------------------------------------------- the course's rules
# What each lesson's snippet computes, restated from the course text (the expected outputs).


def course_num_blocks(n: int, block_size: int) -> int:
    return (n + block_size - 1) // block_size


def course_last_block_num_tokens(n: int, block_size: int) -> int:
    return n - (course_num_blocks(n, block_size) - 1) * block_size


def course_simulate_prefill(prompt_lens: list[int], budget: int) -> tuple[list[list[int]], int]:
    """Lesson 3: [(index, scheduled tokens)], tokens left; only the first sequence of a batch may be cut."""
    scheduled, remaining = [], budget
    for i, n in enumerate(prompt_lens):
        if remaining == 0 or (remaining < n and scheduled):
            break
        take = min(n, remaining)
        scheduled.append([i, take])
        remaining -= take
    return scheduled, remaining


def course_prefill_tensors(seqs: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Lesson 5: (cached, scheduled) per sequence -> cu_seqlens_q, positions."""
    cu, positions = [0], []
    for cached, scheduled in seqs:
        positions += range(cached, cached + scheduled)
        cu.append(cu[-1] + scheduled)
    return cu, positions


def course_decode_slot(last_block: int, block_size: int, last_block_num_tokens: int) -> int:
    return last_block * block_size + last_block_num_tokens - 1


def course_needs_new_block(length: int, block_size: int) -> bool:
    return length % block_size == 1


# --------------------------------------------------------------------------- the exercises


def _seq(seq_id: int, token_ids: list[int], block_size: int, max_tokens: int = 16):
    from engine import SamplingParams
    from engine.sequence import Sequence

    return Sequence(seq_id, list(token_ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True), block_size)


def ex1_generate(model: str | None) -> tuple[dict, dict]:
    """The course: LLM(path, enforce_eager=True, tensor_parallel_size=1).generate(["Hello, nano-vllm!"],
    SamplingParams(temperature=0.1, max_tokens=16)); each output is {"text": decode(token_ids), "token_ids":
    the completion}. Then COURSE.md's predict-then-check: token ids 1..5, max_tokens 4, ignore_eos: how many
    steps, how many positions each."""
    from engine import LLM, SamplingParams
    from labkit.assets.identity import model_identity
    from labkit.assets.resolve import resolve_model

    ref = resolve_model(model, "cpu")
    identity = dict(model_identity(ref.path))
    identity["source"] = ref.source
    llm = LLM(str(ref.path), enforce_eager=True, tensor_parallel_size=1, device="cpu", seed=0)
    try:
        out = llm.generate(["Hello, nano-vllm!"], SamplingParams(temperature=0.1, max_tokens=16, seed=0))[0]
        decoded = llm.tokenizer.decode(out["token_ids"])
        steps: list[dict] = []
        prompt, max_tokens = [1, 2, 3, 4, 5], 4
        second = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                              on_step=lambda s: steps.append({
                                  "step": s.step, "phase": "prefill" if s.is_prefill else "decode",
                                  "positions": s.num_tokens, "route": str(s.route)}))[0]
    finally:
        llm.close()
    want_steps = max_tokens                                  # one prefill gives a token, each decode one more
    want_positions = [len(prompt)] + [1] * (max_tokens - 1)
    facts = {
        "course": "LLM(path, enforce_eager=True, tensor_parallel_size=1).generate(['Hello, nano-vllm!'], "
                  "SamplingParams(temperature=0.1, max_tokens=16))",
        "ours": "engine.LLM(DIR, enforce_eager=True, tensor_parallel_size=1, device='cpu'); DIR from "
                "`labkit model synth --out DIR` or the lab's default model",
        "output_keys": sorted(out),
        "text": out["text"], "token_ids": out["token_ids"], "finish_reason": out["finish_reason"],
        "text_is_decode_of_token_ids": out["text"] == decoded,
        "at_most_max_tokens": 0 < len(out["token_ids"]) <= 16,
        "predict": {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                    "expected_steps": want_steps, "expected_positions_per_step": want_positions,
                    "steps": steps, "token_ids": second["token_ids"]},
    }
    facts["predict"]["agree"] = (len(steps) == want_steps and [s["positions"] for s in steps] == want_positions
                                 and len(second["token_ids"]) == max_tokens)
    facts["agree"] = (facts["text_is_decode_of_token_ids"] and facts["at_most_max_tokens"]
                      and {"text", "token_ids"} <= set(out) and facts["predict"]["agree"])
    return facts, identity


def ex2_sequence() -> dict:
    """The course: block_size 4, Sequence(list(range(n))) for n in [1, 4, 5, 8, 9]: num_blocks,
    last_block_num_tokens, blocks. Ours: Sequence(seq_id, token_ids, params, block_size); the last block's
    tokens are len(seq.block(num_blocks - 1)) (no last_block_num_tokens: slots come from positions)."""
    bs, rows = 4, []
    for n in (1, 4, 5, 8, 9):
        seq = _seq(0, list(range(n)), bs)
        got = {"num_blocks": seq.num_blocks, "last_block_num_tokens": len(seq.block(seq.num_blocks - 1)),
               "blocks": [seq.block(i) for i in range(seq.num_blocks)]}
        nb = course_num_blocks(n, bs)
        want = {"num_blocks": nb, "last_block_num_tokens": course_last_block_num_tokens(n, bs),
                "blocks": [list(range(n))[i * bs:(i + 1) * bs] for i in range(nb)]}
        rows.append({"n": n, "got": got, "expected": want, "agree": got == want})
    return {"course": "Sequence.block_size = 4; Sequence(list(range(n))) for n in [1, 4, 5, 8, 9]",
            "ours": "Sequence(seq_id, list(range(n)), SamplingParams(), block_size=4)",
            "block_size": bs, "rows": rows, "agree": all(r["agree"] for r in rows)}


def ex3_scheduler() -> dict:
    """The course: simulate_prefill([1000, 900, 800], max_num_batched_tokens=1200). Ours: the real
    Scheduler(SchedulerLimits(...), BlockManager(...)), three waiting sequences, one schedule()."""
    from engine import BlockManager, Scheduler, SchedulerLimits

    lens, budget, bs = [1000, 900, 800], 1200, 256
    bm = BlockManager(64, bs)
    sched = Scheduler(SchedulerLimits(max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=4096), bm)
    seqs = [_seq(i, list(range(10_000 * (i + 1), 10_000 * (i + 1) + n)), bs) for i, n in enumerate(lens)]
    for s in seqs:
        sched.add(s)
    batch, is_prefill = sched.schedule()
    got = [[seqs.index(s), s.num_scheduled_tokens] for s in batch]
    want, want_left = course_simulate_prefill(lens, budget)
    left = budget - sum(t for _, t in got)
    return {"course": "simulate_prefill([1000, 900, 800], max_num_batched_tokens=1200)",
            "ours": "Scheduler(SchedulerLimits(max_num_seqs=16, max_num_batched_tokens=1200), BlockManager(64, 256))"
                    "; add three sequences; schedule()",
            "prompt_lens": lens, "budget": budget, "is_prefill": is_prefill,
            "got": {"scheduled": got, "remaining": left}, "expected": {"scheduled": want, "remaining": want_left},
            "agree": is_prefill and got == want and left == want_left}


def ex4_block_manager() -> dict:
    """The course: compute_hash chain of [1,2,3,4] then [5,6,7,8]; seq_a = 1..10 finished and hashed, seq_b =
    [1..8, 11..14]: its cached blocks, new blocks, num_cached_tokens (block size 4). The course's comment
    counts seq_b as 4 blocks and 2 new; 12 tokens are 3 blocks, so 1 new: the real block manager's answer."""
    from engine import BlockManager, chain_hash

    bs = 4
    h0 = chain_hash([1, 2, 3, 4], -1)
    h1 = chain_hash([5, 6, 7, 8], h0)
    bm = BlockManager(16, bs)
    a = _seq(0, list(range(1, 11)), bs)
    bm.allocate(a, [])
    a.num_cached_tokens = a.num_tokens                      # its prefill computed every position
    bm.hash_blocks(a)
    bm.deallocate(a)                                        # finished: blocks free, hashes kept
    b = _seq(1, [1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 13, 14], bs)
    hits = bm.cached_prefix(b)
    free_before = bm.num_free_blocks
    bm.allocate(b, hits)
    fresh = len(b.block_table) - len(hits)
    # the course's counting: full blocks shared with seq_a that hash_blocks wrote back (seq_a's last is partial),
    # looked up among all but seq_b's last block
    a_full = course_num_blocks(10, bs) - (1 if 10 % bs else 0)
    nb = course_num_blocks(b.num_tokens, bs)
    shared = 0
    for i in range(min(a_full, nb - 1)):
        if list(range(1, 11))[i * bs:(i + 1) * bs] != b.token_ids[i * bs:(i + 1) * bs]:
            break
        shared += 1
    want = {"num_cached_blocks": shared, "new_blocks": nb - shared, "num_cached_tokens": shared * bs,
            "num_blocks_b": nb}
    got = {"num_cached_blocks": len(hits), "new_blocks": fresh, "num_cached_tokens": b.num_cached_tokens,
           "num_blocks_b": b.num_blocks}
    return {"course": "compute_hash([1,2,3,4], -1), compute_hash([5,6,7,8], h0); seq_a 1..10 hashed, "
                      "seq_b [1..8, 11..14]: num_cached_blocks, new blocks, num_cached_tokens (block_size 4)",
            "ours": "chain_hash(token_ids, prefix); BlockManager(16, 4): allocate, hash_blocks, deallocate seq_a; "
                    "cached_prefix(seq_b) then allocate(seq_b, hits)",
            "hash_chain": {"h0": h0, "h1": h1, "h1_differs_without_prefix": chain_hash([5, 6, 7, 8], -1) != h1},
            "hits": hits, "free_blocks_before_b": free_before,
            "course_text_says": {"num_blocks_b": 4, "new_blocks": 2},
            "course_text_correct": want["num_blocks_b"] == 4 and want["new_blocks"] == 2,
            "got": got, "expected": want,
            "agree": got == want and len({h0, h1}) == 2}


def ex5_prefill() -> dict:
    """The course: build_prefill_tensors([(0, 3), (4, 2)]) -> cu_seqlens_q [0, 3, 5], positions [0, 1, 2, 4, 5].
    Ours: InputBuilder(block_size, "cpu").plan_prefill on two real sequences (B with 4 tokens cached)."""
    from engine import BlockManager
    from engine.step_inputs import InputBuilder

    bs = 4
    bm = BlockManager(8, bs)
    a = _seq(0, [11, 12, 13], bs)
    b = _seq(1, [21, 22, 23, 24, 25, 26], bs)
    for s, cached, scheduled in ((a, 0, 3), (b, 4, 2)):
        bm.allocate(s, [])
        s.num_cached_tokens, s.num_scheduled_tokens = cached, scheduled
    plan = InputBuilder(bs, "cpu").plan_prefill([a, b])
    inputs = InputBuilder(bs, "cpu").to_inputs(plan)
    meta = inputs.meta
    got = {"cu_seqlens_q": meta.cu_seqlens_q.tolist(), "positions": inputs.positions.tolist()}
    cu, pos = course_prefill_tensors([(0, 3), (4, 2)])
    want = {"cu_seqlens_q": cu, "positions": pos}
    return {"course": "build_prefill_tensors([(0, 3), (4, 2)])",
            "ours": "InputBuilder(4, 'cpu').plan_prefill([a, b]) then to_inputs (a: 3 new; b: 4 cached, 2 new)",
            "got": got, "expected": want,
            "also": {"cu_seqlens_k": meta.cu_seqlens_k.tolist(), "slot_mapping": inputs.meta.slot_mapping.tolist(),
                     "block_tables_given": meta.block_tables is not None},
            "agree": got == want}


def ex6_decode() -> dict:
    """The course: slot(block_table_last=3, block_size=256, last_block_num_tokens=1 and 256); then for
    len(seq) in 7..10 at block size 4, does may_append add a block. Ours: InputBuilder.plan_decode's
    slot_mapping on a sequence whose last block is 3; BlockManager.may_append on a sequence grown by one."""
    from engine import BlockManager
    from engine.step_inputs import InputBuilder

    slots = []
    for last_n in (1, 256):
        seq = _seq(0, [7] * (256 + last_n), 256)
        seq.block_table = [0, 3]                            # its last block is block 3
        slots.append({"last_block_num_tokens": last_n,
                      "got": InputBuilder(256, "cpu").plan_decode([seq]).slot_mapping[0],
                      "expected": course_decode_slot(3, 256, last_n)})
    appends = []
    for length in (7, 8, 9, 10):
        bm = BlockManager(8, 4)
        seq = _seq(0, list(range(length - 1)), 4)
        bm.allocate(seq, [])                                # the blocks of its first length - 1 tokens
        seq.append_token(99)                                # the step's new token: len(seq) = length
        before = len(seq.block_table)
        bm.may_append(seq)
        appends.append({"len": length, "got": len(seq.block_table) > before,
                        "expected": course_needs_new_block(length, 4)})
    agree = all(r["got"] == r["expected"] for r in slots + appends)
    return {"course": "slot(3, 256, 1), slot(3, 256, 256); may_append at len(seq) 7, 8, 9, 10 (block_size 4)",
            "ours": "InputBuilder(256, 'cpu').plan_decode([seq]).slot_mapping; BlockManager.may_append(seq)",
            "slots": slots, "may_append": appends, "agree": agree}


def ex7_store() -> dict:
    """The course: store(cache, slot_mapping=[10, -1, 12], values=[k0, k1, k2]) writes slots 10 and 12 only.
    Ours: the torch backend's store_kv into a paged cache (the engine's CPU path)."""
    import torch

    from engine.attention import create_backend

    bs, blocks = 4, 4
    k_cache = torch.zeros(blocks, bs, 1, 1)
    v_cache = torch.zeros(blocks, bs, 1, 1)
    k = torch.tensor([1.0, 2.0, 3.0]).view(3, 1, 1)          # "k0", "k1", "k2" as 1, 2, 3
    create_backend("torch", bs).store_kv(k, -k, k_cache, v_cache, torch.tensor([10, -1, 12]))
    flat_k, flat_v = k_cache.view(-1), v_cache.view(-1)
    written = {int(i): float(flat_k[i]) for i in torch.nonzero(flat_k).view(-1)}
    want: dict[int, float] = {}
    for i, slot in enumerate([10, -1, 12]):
        if slot != -1:
            want[slot] = float(i + 1)
    return {"course": "store(cache, slot_mapping=[10, -1, 12], values=['k0', 'k1', 'k2'])",
            "ours": "create_backend('torch', 4).store_kv(k, v, k_cache, v_cache, slot_mapping=[10, -1, 12])",
            "got": {str(s): v for s, v in written.items()}, "expected": {str(s): v for s, v in want.items()},
            "v_written_at_the_same_slots": sorted(int(i) for i in torch.nonzero(flat_v).view(-1)) == sorted(want),
            "agree": written == want and sorted(int(i) for i in torch.nonzero(flat_v).view(-1)) == sorted(want)}


def ex8_replay() -> dict:
    """The course: will_replay(is_prefill=True, enforce_eager=False, batch_size=128) and (False, False, 128).
    Ours: ModelRunner.route_for on real step inputs, the decode graphs' buckets standing in for a capture."""
    from labkit.experiments.replay import replay_rows

    rows = replay_rows([128, 513], buckets=None, max_num_seqs=512, phases=("prefill", "decode"))
    course = [r for r in rows if r["batch"] == 128]
    return {"course": "will_replay(True, False, 128), will_replay(False, False, 128)",
            "ours": "ModelRunner.route_for(inputs) with DecodeGraphs buckets default_buckets(512) (largest 512)",
            "rows": rows, "course_rows": course,
            "agree": bool(rows) and all(r["agree"] for r in rows)}


EXERCISES = {2: ex2_sequence, 3: ex3_scheduler, 4: ex4_block_manager, 5: ex5_prefill, 6: ex6_decode,
             7: ex7_store, 8: ex8_replay}
KINDS = {1: "cpu-real-engine", 2: "cpu-real-scheduler", 3: "cpu-real-scheduler", 4: "cpu-real-scheduler",
         5: "cpu-real-scheduler", 6: "cpu-real-scheduler", 7: "cpu-real-engine", 8: "cpu-real-scheduler"}


def exercise_facts(n: int, model: str | None = None) -> tuple[dict, dict | None]:
    check_lesson(n)
    if n == 1:
        return ex1_generate(model)
    return EXERCISES[n](), None


def run_course_ex(n: int, out: Path | None = None, model: str | None = None) -> dict:
    facts, identity = exercise_facts(n, model)
    facts = {"lesson": n, **facts}
    envelope = {"model": identity} if identity else {}
    return write_claimed(f"course.ex-{n}", out, f"course-ex-{n}.json", kind=KINDS[n], facts=facts, device="cpu",
                         **envelope)
