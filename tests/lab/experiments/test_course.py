"""docs/COURSE.md stays true to the code (anchors, checkpoints, commands, one section per lesson), and the
course's teaching switches work: `--no-fused-ops` reaches the engine's Config, `--debug` offers the engine's
modules and one breakpoint per lesson and quits cleanly."""
from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
COURSE = REPO / "docs" / "COURSE.md"

# Names the course may use before the code has them: skipped by the checks below until they exist
# (test_pending_names_are_still_pending fails as soon as one of them resolves, so none stays skipped by accident).
PENDING: set[str] = set()   # names the doc uses before they exist (empty: every name exists)

ANCHOR = re.compile(r"`([\w./-]+\.py)(?::([\w.]+))?`")
CHECKPOINT = re.compile(r"`((?:setup|principles|scheduler|guardrails|cuda|tp|service|patches|models|course)\.[\w-]+)`")
COMMAND = re.compile(r"`(labkit [^`]*)`")
LESSON = re.compile(r"^## Lesson (\d+):", re.M)


# ------------------------------------------------------------------ the checks, as plain functions


def resolve_anchor(path: str, name: str | None, root: Path = REPO) -> str | None:
    """None when `path` exists under root and `name` (Name or Class.method) is defined in it, else why not."""
    file = root / path
    if not file.is_file():
        return f"{path}: no such file"
    if not name:
        return None
    scope: list[ast.stmt] = ast.parse(file.read_text(encoding="utf-8")).body
    for part in name.split("."):
        found = [n for n in scope if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and n.name == part]
        if not found:
            return f"{path}:{name}: {part!r} is not defined there"
        scope = found[0].body if isinstance(found[0], ast.ClassDef) else []
    return None


def our_anchors(text: str) -> list[tuple[str, str | None]]:
    """Every `file.py[:Name]` on a line that begins with `- ours:`."""
    out = []
    for line in text.splitlines():
        if line.lstrip().startswith("- ours:"):
            out += [(m.group(1), m.group(2)) for m in ANCHOR.finditer(line)]
    return out


def _cli_tree():
    import typer

    from labkit.cli import app

    return typer.main.get_command(app)


def check_command(command: str, root_cmd) -> str | None:
    """None when `labkit A [B] --opt ...` names a real (sub)command and real options of it, else why not."""
    words = command.split()[1:]
    cmd, path = root_cmd, ["labkit"]
    while words and hasattr(cmd, "commands") and not words[0].startswith("-"):   # a group (Typer's own click)
        sub = cmd.commands.get(words[0])
        if sub is None:
            name = " ".join(path + [words[0]])
            return None if name in PENDING else f"`{command}`: {name!r} is not a command"
        path.append(words.pop(0))
        cmd = sub
    if hasattr(cmd, "commands"):
        return f"`{command}`: {' '.join(path)!r} needs a subcommand"
    known = {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)}
    for w in words:
        opt = w.split("=", 1)[0]
        if opt.startswith("--") and opt not in known and f"{path[-1]} {opt}" not in PENDING:
            return f"`{command}`: {' '.join(path)} has no option {opt}"
    return None


def course_problems(doc: Path, root: Path = REPO) -> list[str]:
    """Everything in the course file that is not true of the code: [] when it all holds."""
    from labkit.checks import load_checkpoints

    text = doc.read_text(encoding="utf-8")
    problems = []
    lessons = [int(n) for n in LESSON.findall(text)]
    if sorted(lessons) != list(range(1, 9)):
        problems.append(f"lessons {lessons}: want one section for each of 1..8")
    anchors = our_anchors(text)
    if len(anchors) < 8:
        problems.append(f"only {len(anchors)} anchors of ours")
    problems += [p for p in (resolve_anchor(f, n, root) for f, n in anchors) if p]
    ids = {c.id for c in load_checkpoints()}
    named = set(CHECKPOINT.findall(text))
    problems += [f"checkpoint {c} does not exist" for c in sorted(named - ids - PENDING)]
    if not named:
        problems.append("no checkpoint named")
    tree = _cli_tree()
    commands = COMMAND.findall(text)
    problems += [p for p in (check_command(c, tree) for c in commands) if p]
    if not commands:
        problems.append("no labkit command named")
    return problems


# ------------------------------------------------------------------ the course file


def test_course_names_only_what_exists():
    assert course_problems(COURSE) == []


def _mutate_anchor(text: str) -> str:
    line = next(ln for ln in text.splitlines() if ln.startswith("- ours:") and "Scheduler.schedule`" in ln)
    return text.replace(line, line.replace("Scheduler.schedule`", "Scheduler.schedule_all`"))


def _mutate_file(text: str) -> str:
    return text.replace("- ours: `engine/block_manager.py:", "- ours: `engine/blocks.py:", 1)


def _mutate_checkpoint(text: str) -> str:
    return text.replace("`setup.quick-walk-c`", "`setup.quick-walk-e`", 1)


def _mutate_command(text: str) -> str:
    return text.replace("`labkit quick-walk --case A --trace`", "`labkit quick-walks --case A --trace`", 1)


def _mutate_option(text: str) -> str:
    return text.replace("`labkit quick-walk --case A --trace`", "`labkit quick-walk --case A --tracing`", 1)


def _mutate_lesson(text: str) -> str:
    return text.replace("## Lesson 6:", "## Lesson six:", 1)


@pytest.mark.parametrize("mutate, needle", [
    (_mutate_anchor, "Scheduler.schedule_all"), (_mutate_file, "engine/blocks.py: no such file"),
    (_mutate_checkpoint, "setup.quick-walk-e"), (_mutate_command, "'labkit quick-walks' is not a command"),
    (_mutate_option, "no option --tracing"), (_mutate_lesson, "want one section for each of 1..8"),
])
def test_the_course_check_fails_on_a_renamed_name(tmp_path, mutate, needle):
    """The check above can fail: a copy of the course with one name changed is reported, with that name."""
    text = COURSE.read_text(encoding="utf-8")
    changed = mutate(text)
    assert changed != text, "the mutation found nothing to change"
    doc = tmp_path / "COURSE.md"
    doc.write_text(changed, encoding="utf-8")
    problems = course_problems(doc)
    assert any(needle in p for p in problems), problems


def test_pending_names_are_still_pending():
    """PENDING skips only names that do not exist yet: once one exists, it must leave PENDING."""
    from labkit.checks import load_checkpoints

    tree = _cli_tree()
    ids = {c.id for c in load_checkpoints()}
    arrived = []
    for name in PENDING:
        if name.startswith("labkit "):
            words, cmd = name.split()[1:], tree
            while words and hasattr(cmd, "commands") and words[0] in cmd.commands:
                cmd = cmd.commands[words.pop(0)]
            if not words:
                arrived.append(name)
        elif " --" in name:
            command, opt = name.split(" ", 1)
            sub = tree.commands[command]
            if any(opt in (*p.opts, *p.secondary_opts) for p in sub.params):
                arrived.append(name)
        elif name in ids:
            arrived.append(name)
    assert not arrived, f"these exist now: remove them from PENDING in tests/lab/experiments/test_course.py: {arrived}"


def test_lab_guide_links_every_lesson():
    lab = (REPO / "docs" / "LAB.md").read_text(encoding="utf-8")
    course = COURSE.read_text(encoding="utf-8")
    slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
             for h in re.findall(r"^## (Lesson \d+:.+)$", course, re.M)}
    linked = set(re.findall(r"COURSE\.md#(lesson-\d+[\w-]*)", lab))
    assert linked <= slugs, linked - slugs
    assert {s.split("-")[1] for s in linked} == {str(i) for i in range(1, 9)}, sorted(linked)
    assert "docs/COURSE.md" in (REPO / "README.md").read_text(encoding="utf-8")


# ------------------------------------------------------------------ --fused-ops / --no-fused-ops


def test_no_fused_ops_reaches_the_engine_config(tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    from labkit.cli import app

    seen = {}
    for flag in ("--fused-ops", "--no-fused-ops"):
        out = tmp_path / f"g{flag}.json"
        res = CliRunner().invoke(app, ["generate", "--token-ids", "1,2,3", "--max-tokens", "2", flag,
                                       "--model", str(tiny_model_dir), "--device", "cpu", "--out", str(out)])
        assert res.exit_code == 0, res.output
        engine = json.loads(out.read_text())["engine"]
        seen[flag] = (engine["config"]["fused_ops"], engine["fused_ops"])
    # the switch is recorded in the evidence's engine config; on a CPU the fused kernels never run
    assert seen == {"--fused-ops": (True, False), "--no-fused-ops": (False, False)}


def test_quick_walk_takes_no_fused_ops(tiny_model_dir, tmp_path):
    """Lesson 7's command: quick-walk passes --no-fused-ops to the engine it builds (recorded in the evidence)."""
    from typer.testing import CliRunner

    from labkit.cli import app

    out = tmp_path / "a.json"
    res = CliRunner().invoke(app, ["quick-walk", "--case", "A", "--no-fused-ops", "--model", str(tiny_model_dir),
                                   "--device", "cpu", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["engine"]["config"]["fused_ops"] is False


def test_enable_fused_ops_is_off_with_the_switch_even_past_the_device_check(lab_engine, monkeypatch):
    # fused_kernels importable whatever this machine has (the CUDA kernels are never called here)
    monkeypatch.setitem(sys.modules, "engine.layers.fused_kernels", types.ModuleType("engine.layers.fused_kernels"))
    llm = lab_engine(fused_ops=False, kvcache_block_size=256)
    try:
        runner = llm.runner
        monkeypatch.setattr(runner, "device", "cuda")        # past `if not cuda: return False`
        assert llm.config.fused_ops is False
        assert runner._enable_fused_ops() is False
        assert not any(getattr(m, "fused", False) for m in runner.model.modules())
        llm.config.args = dataclasses.replace(llm.config.args, fused_ops=True)   # the switch on: the kernels
        assert runner._enable_fused_ops() is True
        assert any(getattr(m, "fused", False) for m in runner.model.modules())
    finally:
        monkeypatch.undo()                                    # the CPU device again before close()
        llm.close()


# ------------------------------------------------------------------ --debug


def test_debug_breakpoints_are_computed_from_the_source():
    from labkit.experiments.walk_debug import LESSON_BREAKPOINTS, lesson_breakpoints

    got = lesson_breakpoints()
    assert [b["lesson"] for b in got] == list(range(1, 9)) == [b[0] for b in LESSON_BREAKPOINTS]
    for b in got:
        qual = b["target"].split(":")[1]
        src = (REPO / b["file"]).read_text(encoding="utf-8").splitlines()
        tree = ast.parse("\n".join(src))
        fn = tree
        for part in qual.split("."):
            fn = next(n for n in fn.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)) and n.name == part)
        # the line is a statement of that function's body (pdb stops there on every call)
        assert fn.lineno < b["line"] <= fn.end_lineno, b
        assert not src[b["line"] - 1].strip().startswith(("def ", '"""', "@")), b


def _console_script() -> Path:
    """The installed `labkit` console script beside this Python (pip install -e . puts it there)."""
    script = Path(sys.executable).with_name("labkit")
    assert script.is_file(), f"no console script {script}: install the project with `pip install -e .`"
    return script


def _debug_walk(case: str, script: str, model: Path, out: Path) -> subprocess.CompletedProcess:
    """`labkit quick-walk --case CASE --debug` through the installed console script, from the project root,
    with no PYTHONPATH (where a learner runs it: pdb then looks for a relative file from the script's
    directory, not from here)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(_console_script()), "quick-walk", "--case", case, "--trace", "--debug",
                           "--model", str(model), "--out", str(out)],
                          input=script, capture_output=True, text=True, timeout=300, cwd=REPO, env=env)


def test_debug_prompt_offers_the_modules_stops_at_a_lesson_breakpoint_and_quits_cleanly(tiny_model_dir, tmp_path):
    from labkit.experiments.walk_debug import lesson_breakpoints

    bps = lesson_breakpoints()
    lesson3 = next(b for b in bps if b["lesson"] == 3)
    script = "\n".join([
        "p type(llm).__name__, scheduler_mod.__name__, block_manager_mod.BlockManager.__name__, engine_pkg.__name__",
        "b engine_module.LLMEngine.step", *(b["command"] for b in bps),   # the handbook's breakpoint first, then
        "disable " + " ".join(str(2 + i) for i, b in enumerate(bps) if b["lesson"] != 3),   # all but lesson 3's off
        "c", "c", "p len(self.waiting), self.waiting[0].num_tokens", "q"]) + "\n"
    res = _debug_walk("A", script, tiny_model_dir, tmp_path / "a.json")
    both = res.stdout + res.stderr
    assert res.returncode == 0, both
    assert "('LLMEngine', 'engine.scheduler', 'BlockManager', 'engine')" in res.stdout
    for b in bps:                                               # the banner: one breakpoint per lesson, each
        assert f"{b['command']}" in res.stderr and f"lesson {b['lesson']}:" in res.stderr    # set by pdb as printed
        assert f"at {b['file']}:{b['line']}" in res.stdout, (b, res.stdout[-2000:])
    assert "not found from sys.path" not in res.stdout and "*** " not in res.stdout
    assert res.stdout.count("Breakpoint ") == len(bps) + 1
    assert "llm_engine.py(" in res.stdout and ")step()" in res.stdout     # stopped in LLMEngine.step, then
    assert f"scheduler.py({lesson3['line']})schedule()" in res.stdout   # inside Scheduler.schedule
    assert "(1, 3)" in res.stdout                               # case A's one request of 3 tokens, waiting
    assert "Traceback" not in both and "BdbQuit" not in both
    assert not (tmp_path / "a.json").exists()                   # quit before the walk ended: no evidence


def test_debug_on_the_prefix_walk_stops_in_allocate_on_the_prefix_hit(tiny_model_dir, tmp_path):
    """Lesson 4's breakpoint, as the banner prints it, passes A's admission (no hit) and stops at B's: the two
    blocks A left hashed, B's 620 tokens. Then the lifecycle walk takes --debug too."""
    from labkit.experiments.walk_debug import lesson_breakpoints

    lesson4 = next(b for b in lesson_breakpoints() if b["lesson"] == 4)
    res = _debug_walk("prefix", f"{lesson4['command']}\nc\np hits, seq.num_tokens, len(seq.block_table)\nq\n",
                      tiny_model_dir, tmp_path / "p.json")
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"block_manager.py({lesson4['line']})allocate()" in res.stdout
    assert "([0, 1], 620, 0)" in res.stdout, res.stdout[-1500:]
    res = _debug_walk("lifecycle", "p len(llm.scheduler.waiting)\nq\n", tiny_model_dir, tmp_path / "l.json")
    assert res.returncode == 0 and "(Pdb) 0" in res.stdout, res.stdout + res.stderr
