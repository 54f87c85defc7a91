"""The house's rules, read from the code: labkit and the server reach the engine only through its public API
and hooks, the engine imports neither, the server (serve/) imports the engine and nothing of the lab, and no two
modules import each other in a circle, nor two folders (a package below the top one, e.g. ``labkit.load``; a
module at a package's top level is a box of its own)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENGINE_INTERNALS = {"runner", "scheduler", "block_manager"}
INTERNAL_MODULES = {"engine.model_runner", "engine.scheduler", "engine.block_manager", "engine.tp_workers"}


def modules(package: str) -> dict[str, Path]:
    out = {}
    for path in sorted((REPO / package).rglob("*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module of ours that `name` imports, at the top or inside a function."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph() -> dict[str, set[str]]:
    mods = {**modules("engine"), **modules("serve"), **modules("labkit")}
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def test_labkit_never_reaches_into_engine_internals():
    offenders = []
    for name, path in {**modules("serve"), **modules("labkit")}.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ENGINE_INTERNALS:
                offenders.append(f"{path.relative_to(REPO)}:{node.lineno} .{node.attr}")
        for target in imports_of(name, path, INTERNAL_MODULES | {"engine"}):
            if target in INTERNAL_MODULES:
                offenders.append(f"{path.relative_to(REPO)} imports {target}")
    assert not offenders, "labkit must use the engine's public API (LLMEngine methods, hooks):\n" + "\n".join(offenders)


def test_the_rule_catches_a_reach_into_the_engine(tmp_path):
    """The check above can fail: a module that reads engine.scheduler is reported."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f(engine):\n    return len(engine.scheduler.waiting)\n")
    tree = ast.parse(bad.read_text())
    assert any(isinstance(n, ast.Attribute) and n.attr in ENGINE_INTERNALS for n in ast.walk(tree))


def test_engine_never_imports_labkit():
    g = graph()
    bad = {m: sorted(t for t in ts if t.startswith(("labkit", "serve"))) for m, ts in g.items() if m.startswith("engine")}
    assert not {m: ts for m, ts in bad.items() if ts}


def test_serve_imports_only_the_engine():
    """serve/ is a package beside the engine: it imports the engine and itself, nothing of the lab (the lab hands
    in what only it knows: the engine builder's name, its evidence envelope, where logs go)."""
    g = graph()
    bad = {m: sorted(t for t in ts if not t.startswith(("engine", "serve"))) for m, ts in g.items()
           if m == "serve" or m.startswith("serve.")}
    assert {m: ts for m, ts in bad.items() if ts} == {}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    # a package's __init__ re-exporting its own modules is a face, not a circle
    g = {m: {t for t in ts if not (m == t.rpartition(".")[0] or t == m.rpartition(".")[0])} for m, ts in graph().items()}
    assert cycles(g) == []


def test_the_circle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def folder(module: str, packages: set[str]) -> str:
    """The box a module sits in: its package below the top one, or the module itself at the top."""
    parts = module.split(".")
    if len(parts) >= 3 or module in packages and len(parts) == 2:
        return ".".join(parts[:2])
    return module


def folder_graph(g: dict[str, set[str]], packages: set[str]) -> dict[str, set[str]]:
    """The arrows between boxes of a module graph; a package's face (its __init__) re-exporting its own
    modules is not one."""
    out: dict[str, set[str]] = {}
    for m, ts in g.items():
        for t in ts:
            a, b = folder(m, packages), folder(t, packages)
            if a != b and not (m in packages and t.startswith(m + ".")):
                out.setdefault(a, set()).add(b)
    return out


def test_no_import_loops_between_folders():
    packages = {m for pkg in ("engine", "serve", "labkit") for m, p in modules(pkg).items() if p.name == "__init__.py"}
    assert cycles(folder_graph(graph(), packages)) == []


def test_the_folder_rule_catches_a_loop_no_module_circle_shows():
    # two modules of each folder, no module imports back the one that imports it: a loop of folders only
    g = {"labkit.load.sweep": {"labkit.pictures.sweep"}, "labkit.pictures.explorer": {"labkit.load.report"},
         "engine.config": {"engine.models.families"}, "engine.models.qwen3": {"engine.config"}}
    packages = {"labkit", "labkit.load", "labkit.pictures", "engine", "engine.models"}
    assert cycles(g) == []
    assert cycles(folder_graph(g, packages)) == [["engine.config", "engine.models"], ["labkit.load", "labkit.pictures"]]


def test_private_names_stay_inside_their_module():
    """A name another module imports is that module's API and is named so (public): fewer than 15 private names
    (``_x``) cross a module boundary in engine/, serve/ and labkit/, as tools/house_figures.py counts them."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("house_figures", REPO / "tools" / "house_figures.py")
    house = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(house)
    private = house.figures(REPO)["private_names_imported_across_modules"]
    assert len(private) < 15, private
