"""The engine's options on the command line, declared once: every engine flag a command takes is spelled and
explained in engine/args.py's FLAGS (no command declares one inline), and the default of ``max_num_seqs`` is
written in engine/args.py alone (the engine's default and its named presets), never again as a literal in a
command, a preset dict elsewhere, a parameter default or an ``or`` fallback."""
from __future__ import annotations

import ast
from pathlib import Path

from engine.args import FLAGS, PRESETS, DEFAULTS, preset

ROOT = Path(__file__).resolve().parents[3]
#: Same spelling, another thing: not the engine's option (each with what it is).
OTHER_MEANING = {
    ("labkit/cli/model.py", "--dtype"): "the dtype of the weights model synth writes, model fetch converts to",
    ("labkit/cli/model.py", "--device"): "where model synth draws its random weights",
    ("labkit/cli/principles.py", "--seed"): "the softmax principle's sampler seed",
    ("labkit/cli/options.py", "--seed"): "SeedOpt: a command's own seed (a trace's, a request's)",
}


def _spellings() -> dict[str, str]:
    return {part: name for name, flag in FLAGS.items() for spelled in flag.names for part in spelled.split("/")}


def inline_engine_flags(root: Path = ROOT) -> list[str]:
    """``typer.Option("--max-num-seqs", ...)`` written out in a command module instead of taken from FLAGS."""
    spell, found = _spellings(), []
    for path in sorted((root / "labkit").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "Option":
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        hits = [p for p in arg.value.split("/") if p in spell]
                        if hits and (rel, hits[0]) not in OTHER_MEANING:
                            found.append(f"{rel}:{node.lineno} {arg.value}")
    return found


def _is_literal_int(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool)


def _outside_functions(node):
    """Every node of ``node`` that is not inside a function body (a function's own defaults are)."""
    for child in ast.iter_child_nodes(node):
        yield child
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            yield from (d for d in (*child.args.defaults, *child.args.kw_defaults) if d is not None)
        else:
            yield from _outside_functions(child)


def max_num_seqs_defaults(root: Path = ROOT) -> list[str]:
    """Where a default of max_num_seqs is written as a number outside engine/args.py: a parameter default
    (a function's or a command's), ``max_num_seqs or N``, and a module-level dict or call (a preset) naming it."""
    found = []
    for top in ("labkit", "serve", "engine"):
        for path in sorted((root / top).rglob("*.py")):
            if path == root / "engine" / "args.py":
                continue
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    args = node.args
                    pairs = list(zip(args.args[len(args.args) - len(args.defaults):], args.defaults))
                    pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
                    found += [f"{rel}:{d.lineno} parameter default" for a, d in pairs
                              if a.arg == "max_num_seqs" and _is_literal_int(d)]
                if (isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and len(node.values) == 2
                        and isinstance(node.values[0], ast.Name) and node.values[0].id == "max_num_seqs"
                        and _is_literal_int(node.values[1])):
                    found.append(f"{rel}:{node.lineno} max_num_seqs or N")
            for node in _outside_functions(tree):       # module and class level: preset dicts and calls
                if isinstance(node, ast.Dict):
                    found += [f"{rel}:{v.lineno} preset" for k, v in zip(node.keys, node.values)
                              if isinstance(k, ast.Constant) and k.value == "max_num_seqs" and _is_literal_int(v)]
                if isinstance(node, ast.Call):
                    found += [f"{rel}:{k.value.lineno} preset" for k in node.keywords
                              if k.arg == "max_num_seqs" and _is_literal_int(k.value)]
    return found


def test_every_engine_flag_comes_from_the_one_table():
    assert inline_engine_flags() == []


def test_the_max_num_seqs_default_is_written_in_engine_args_alone():
    assert max_num_seqs_defaults() == []


def test_the_scans_find_what_they_look_for(tmp_path):
    for top in ("labkit", "serve", "engine"):
        (tmp_path / top).mkdir()
    (tmp_path / "labkit" / "cmd.py").write_text(
        "import typer\n"
        "def serve(n: int = typer.Option(8, '--max-num-seqs'), e: bool = typer.Option(True, '--enforce-eager/--graph')):\n"
        "    pass\n"
        "def walk(max_num_seqs: int = 256):\n"
        "    return max_num_seqs or 256\n"
        "SETTINGS = {'cuda': dict(max_num_seqs=256), 'cpu': {'max_num_seqs': 8}}\n")
    assert [f.split(" ", 1)[1] for f in inline_engine_flags(tmp_path)] == ["--max-num-seqs", "--enforce-eager/--graph"]
    assert sorted(f.split(" ", 1)[1] for f in max_num_seqs_defaults(tmp_path)) == [
        "max_num_seqs or N", "parameter default", "preset", "preset"]


def test_the_table_names_real_options_and_its_presets_build():
    from engine.args import OPTION_NAMES

    assert set(FLAGS) <= set(OPTION_NAMES)
    for name in PRESETS:
        assert preset(name) != DEFAULTS
    spelled = [part for flag in FLAGS.values() for s in flag.names for part in s.split("/")]
    assert len(spelled) == len(set(spelled))
