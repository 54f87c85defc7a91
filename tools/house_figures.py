#!/usr/bin/env python3
"""The house's figures, read from the code with Python's ``ast`` (nothing of the project is imported or run).

- lines (physical) and files per package: ``engine``, ``serve`` (where it exists), ``labkit``;
- modules over 450 lines;
- private names (``_x``, not dunder) imported by one module of ours from another;
- import loops between folders (a folder: a package below the top one, e.g. ``labkit.bench``; a module at a
  package's top level is a box of its own), over the imports at the top of a file and inside functions;
- where a ``max_num_seqs`` default is written: a literal integer bound to ``max_num_seqs`` outside a function body
  (a module constant, a class field) or as a parameter default.

usage: tools/house_figures.py [--repo DIR] [--json]
"""
from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "lab"))
from test_layout import cycles, folder  # noqa: E402  (the circle finder and the boxes of the house rules)

PACKAGES = ("engine", "serve", "labkit")
BIG = 450


def modules(repo: Path) -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((repo / package).rglob("*.py")):
            parts = list(path.relative_to(repo).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imported(name: str, path: Path, tree: ast.AST, known: set[str]) -> list[tuple[str, str | None]]:
    """(module of ours, imported name or None) for every import in ``tree``."""
    found = []
    pkg_parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                t = a.name
                while t and t not in known:
                    t = t.rpartition(".")[0]
                if t:
                    found.append((t, None))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg_parts[: len(pkg_parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in known:                     # a submodule, not a name
                    found.append((full, None))
                    continue
                t = base
                while t and t not in known:
                    t = t.rpartition(".")[0]
                if t:
                    found.append((t, a.name))
    return found


def default_homes(path: Path, tree: ast.AST, repo: Path) -> list[str]:
    """Lines that write a literal ``max_num_seqs`` outside a function body (a module constant, a class field)
    or as a parameter's default: the places a default lives. A value a function picks is not counted."""
    where = []
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
              for stmt in (f.body if isinstance(f.body, list) else [f.body]) for n in ast.walk(stmt)}

    def literal(node) -> bool:
        return isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool)

    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and node.target.id == "max_num_seqs" and node.value is not None and literal(node.value):
            where.append(node.lineno)
        elif id(node) in inside:
            continue
        elif isinstance(node, ast.keyword) and node.arg == "max_num_seqs" and literal(node.value):
            where.append(node.value.lineno)
        elif isinstance(node, ast.Dict):
            where += [v.lineno for k, v in zip(node.keys, node.values)
                      if isinstance(k, ast.Constant) and k.value == "max_num_seqs" and literal(v)]
        elif isinstance(node, ast.arguments):
            args = node.posonlyargs + node.args
            for a, d in zip(args[len(args) - len(node.defaults):], node.defaults):
                if a.arg == "max_num_seqs" and literal(d):
                    where.append(d.lineno)
            for a, d in zip(node.kwonlyargs, node.kw_defaults):
                if a.arg == "max_num_seqs" and d is not None and literal(d):
                    where.append(d.lineno)
    return [f"{path.relative_to(repo)}:{n}" for n in sorted(set(where))]


def figures(repo: Path) -> dict:
    mods = modules(repo)
    known = set(mods)
    packages = {m for m, p in mods.items() if p.name == "__init__.py"}
    trees = {m: ast.parse(p.read_text(encoding="utf-8")) for m, p in mods.items()}
    lines = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in mods.items()}

    per_package = {}
    for package in PACKAGES:
        names = [m for m in mods if m == package or m.startswith(package + ".")]
        if names:
            per_package[package] = {"lines": sum(lines[m] for m in names), "files": len(names)}

    private, folder_graph = [], {}
    homes = []
    for m, tree in trees.items():
        homes += default_homes(mods[m], tree, repo)
        for target, nm in imported(m, mods[m], tree, known):
            if target == m:
                continue
            if nm and nm.startswith("_") and not nm.startswith("__"):
                private.append(f"{mods[m].relative_to(repo)} <- {target}.{nm}")
            a, b = folder(m, packages), folder(target, packages)
            # a package's face (its __init__) re-exporting its own modules is not an arrow between boxes
            if a != b and not (m in packages and target.startswith(m + ".")):
                folder_graph.setdefault(a, set()).add(b)

    big = sorted(((lines[m], str(mods[m].relative_to(repo))) for m in mods if lines[m] > BIG), reverse=True)
    return {
        "packages": per_package,
        "labkit_plus_serve_lines": sum(v["lines"] for k, v in per_package.items() if k in ("labkit", "serve")),
        "files_over_450": [f"{p} {n}" for n, p in big],
        "private_names_imported_across_modules": sorted(private),
        "folder_loops": cycles(folder_graph),
        "max_num_seqs_default_homes": homes,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]))
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--list", action="store_true", help="list every private name and default home")
    a = ap.parse_args()
    f = figures(Path(a.repo))
    if a.json:
        print(json.dumps(f, indent=2))
        return 0
    for package, v in f["packages"].items():
        print(f"{package + '/':10} {v['lines']:>7,} lines in {v['files']} files")
    print(f"labkit + serve: {f['labkit_plus_serve_lines']:,} lines")
    print(f"modules over {BIG} lines: {len(f['files_over_450'])}")
    for row in f["files_over_450"]:
        print(f"  {row}")
    private = f["private_names_imported_across_modules"]
    print(f"private names imported across modules: {len(private)}")
    for row in private if a.list else []:
        print(f"  {row}")
    print(f"import loops between folders: {len(f['folder_loops'])}")
    for comp in f["folder_loops"]:
        print(f"  {' <-> '.join(comp)}")
    homes = f["max_num_seqs_default_homes"]
    print(f"max_num_seqs defaults written (module constants, fields, parameter defaults): {len(homes)}")
    for row in homes:
        print(f"  {row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
