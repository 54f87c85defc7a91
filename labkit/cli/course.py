"""``labkit course show N | ex N | replay``: the companion course's lessons on this engine (docs/COURSE.md).

Thin shells over labkit/experiments/course.py and replay.py; the commands that write evidence end through
:func:`labkit.cli.app.finish`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from labkit.cli.app import finish
from labkit.cli.options import PRESETS, JsonOpt, ModelOpt, OutOpt, engine_flag
from labkit.console import console, dict_table, note, print_json, rel
from labkit.errors import UserError
from labkit.paths import default_out

course_app = typer.Typer(help="The companion course's lessons on this engine (docs/COURSE.md): each lesson's "
                              "functions with file:line, its exercise run and judged, lesson 8's replay rule.",
                         no_args_is_help=True)
LessonArg = Annotated[int, typer.Argument(metavar="N", help="The lesson, 1 to 8.", show_default=False)]


SourceOpt = Annotated[bool, typer.Option("--source", help="Also write the functions' source, numbered as in their "
                                          "files, to runs/course-lesson-N-source.txt (or --out).")]
SourceOutOpt = Annotated[Optional[Path], typer.Option("--out", "-o", dir_okay=False,
                                                      help="With --source: the text file to write.")]


@course_app.command("show")
def course_show(lesson: LessonArg, source: SourceOpt = False, out: SourceOutOpt = None,
                json_out: JsonOpt = False) -> None:
    """Lesson N's functions in this engine (docs/COURSE.md's `- ours:` anchors) with the file:line of each;
    --source writes their source to runs/course-lesson-N-source.txt."""
    from labkit.experiments.course import lesson_functions, lesson_source

    got = lesson_functions(lesson)
    if out is not None and not source:
        raise UserError("--out names the file --source writes: add --source")
    if source:
        path = out or default_out(f"course-lesson-{lesson}-source.txt")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(lesson_source(got) + "\n", encoding="utf-8")
        got["source"] = str(path)
    if json_out:
        print_json(got)
        return
    rows = [{"function": f["name"] or "(the file)", "file:line": f"{f['file']}:{f['line'] if f['line'] else '?'}"}
            for f in got["functions"]]
    console.print(dict_table(rows, title=f"lesson {lesson}: {got['title']}"))
    missing = [f["anchor"] for f in got["functions"] if f["line"] is None]
    if missing:
        raise UserError(f"docs/COURSE.md names what the code does not define: {', '.join(missing)}")
    if source:
        console.print(f"the lesson's source, numbered as in its files: {rel(got['source'])}", soft_wrap=True)
    from labkit.experiments.walk_debug import MODULES

    alias = {m.replace(".", "/") + ".py": name for name, m in MODULES.items()}
    first = next((f for f in got["functions"] if f["name"] and "." in f["name"] and f["file"] in alias), None)
    if first:
        console.print(f"in pdb (`labkit quick-walk --case A --debug`): b {alias[first['file']]}.{first['name']} "
                      "stops when it is called; the banner prints one file:line breakpoint per lesson", soft_wrap=True)


@course_app.command("ex")
def course_ex(lesson: LessonArg, model: ModelOpt = None, out: OutOpt = None, json_out: JsonOpt = False) -> None:
    """Run lesson N's exercise (the course's snippet translated to this engine) and judge it against the
    course's expected output, computed by the course's rule; evidence runs/course-ex-N.json."""
    from labkit.experiments.course import check_lesson, run_course_ex

    check_lesson(lesson)
    record = run_course_ex(lesson, out, str(model) if model else None)
    if not json_out:
        render_exercise(record["facts"])
    finish(record, record["_paths"]["json"], json_out=json_out)


def _short(value) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 90 else text[:87] + "..."


def render_exercise(f: dict) -> None:
    console.print(f"lesson {f['lesson']}, the course's exercise: {f['course']}", soft_wrap=True)
    console.print(f"on this engine: {f['ours']}", soft_wrap=True)
    rows = []
    for key in ("rows", "slots", "may_append"):
        for r in f.get(key) or []:
            got = r.get("got", r.get("route"))
            want = r.get("expected", r.get("course_will_replay"))
            label = {k: v for k, v in r.items() if k not in ("got", "expected", "agree", "route", "kind", "bucket",
                                                              "course_will_replay", "course_bucket")}
            agree = r.get("agree", got == want)
            rows.append({"case": _short(label), "engine": _short(got), "course": _short(want),
                         "agree": str(agree).lower()})
    if "got" in f:
        rows.append({"case": "result", "engine": _short(f["got"]), "course": _short(f["expected"]),
                     "agree": str(f["agree"]).lower()})
    if f.get("predict"):
        p = f["predict"]
        rows.append({"case": f"predict: {len(p['prompt'])} prompt tokens, max_tokens {p['max_tokens']}",
                     "engine": _short([s["positions"] for s in p["steps"]]),
                     "course": _short(p["expected_positions_per_step"]), "agree": str(p["agree"]).lower()})
    if rows:
        console.print(dict_table(rows, title="engine vs the course's expected output"))
    if "course_text_correct" in f and not f["course_text_correct"]:
        said = f["course_text_says"]
        note(f"the course's comment counts seq_b as {said['num_blocks_b']} blocks, {said['new_blocks']} of them new; "
             f"by its own rule its tokens make {f['expected']['num_blocks_b']} blocks, so "
             f"{f['expected']['new_blocks']} new (the engine agrees)")
    console.print(f"agree: {str(f['agree']).lower()}")


@course_app.command("replay")
def course_replay(
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", help="Comma-separated batch sizes (decode: sequences; prefill: tokens).")] = "1,3,8,100,128,512,513",
    buckets: Annotated[Optional[str], typer.Option("--buckets", help="Comma-separated decode graph buckets (default: the engine's default_buckets(--max-num-seqs)).")] = None,
    prefill_buckets: Annotated[Optional[str], typer.Option("--prefill-buckets", help="Comma-separated prefill graph buckets (tokens); default none (the engine captures them for the triton backend only).")] = None,
    max_num_seqs: engine_flag("max_num_seqs", "Here: it sets the default buckets (default nano-vllm's).") = PRESETS["nano-vllm"]["max_num_seqs"],
    enforce_eager: engine_flag("enforce_eager", "Here: no graphs captured, every step eager.") = False,
    out: OutOpt = None, json_out: JsonOpt = False,
) -> None:
    """Lesson 8's replay rule on a CPU: ModelRunner.route_for and the graphs' bucket_for on real step inputs, per
    batch size, beside the course's will_replay; evidence runs/course-replay.json."""
    from labkit.experiments.replay import run_replay

    record = run_replay(out, _ints(batch_sizes, "--batch-sizes"), _ints(buckets, "--buckets") if buckets else None,
                        max_num_seqs, enforce_eager, _ints(prefill_buckets, "--prefill-buckets") if prefill_buckets else None)
    f = record["facts"]
    if not json_out:
        console.print(dict_table([{"phase": r["phase"], "batch": r["batch"], "route (engine)": r["route"],
                                   "will_replay (course)": str(r["course_will_replay"]).lower(),
                                   "bucket (course)": "-" if r["course_bucket"] is None else r["course_bucket"],
                                   "agree": str(r["agree"]).lower()} for r in f["rows"]],
                                 title=f"route per step: buckets {f['buckets'][:6]}{'...' if len(f['buckets']) > 6 else ''} "
                                       f"(largest {f['largest_bucket']})"))
        console.print(f"evidence: {rel(record['_paths']['json'])}")
    finish(record, record["_paths"]["json"], json_out=json_out)


def _ints(text: str, option: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{option}: comma-separated whole numbers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UserError(f"{option}: comma-separated numbers of at least 1, got {text!r}")
    return values


def register(app: typer.Typer) -> None:
    app.add_typer(course_app, name="course")
