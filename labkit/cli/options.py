"""Typer option types shared by the command modules (setup, model, guardrails, service), and the engine's options
as Typer options.

The engine's options are declared once, in engine/args.py (``FLAGS``: vLLM's spellings and the help;
``PRESETS``: the named settings). :func:`engine_flag` makes one of them a Typer option type;
:func:`engine_options` adds several to a command at once, their defaults named in ``--help`` from the presets the
command starts from, their given values handed to it as one dict.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import sys
import typing
from pathlib import Path
from typing import Annotated, Optional

import typer


def _engine_args():
    """engine/args.py. Where another package named ``engine`` comes first on the path, this project's file is
    read by its path instead (with its one import, engine/errors.py), so that the command line still starts
    and ``labkit doctor`` can say which engine Python imports."""
    here = Path(__file__).resolve().parents[2] / "engine"
    try:
        from engine import args

        if Path(args.__file__).resolve() == here / "args.py":
            return args
    except ImportError:
        pass

    def load(name: str, file: str):
        spec = importlib.util.spec_from_file_location(name, here / file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    saved = sys.modules.get("engine.errors")
    sys.modules["engine.errors"] = load("labkit_project_engine_errors", "errors.py")
    try:
        return load("labkit_project_engine_args", "args.py")
    finally:
        if saved is None:
            del sys.modules["engine.errors"]
        else:
            sys.modules["engine.errors"] = saved


_args = _engine_args()
DEFAULTS, FLAGS, PRESETS, preset = _args.DEFAULTS, _args.FLAGS, _args.PRESETS, _args.preset

OutOpt = Annotated[
    Optional[Path],
    typer.Option("--out", "-o", dir_okay=False, help="Evidence file to write (default: the checkpoint's file under runs/)."),
]
ModelOpt = Annotated[
    Optional[Path],
    typer.Option("--model", help="Model directory (Hugging Face layout) or a hub id ORG/NAME (from the local HF cache); default $MODEL_DIR, else a synthetic model."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout instead of tables.")]


def engine_flag(name: str, note: str = "", **option):
    """Engine option ``name`` (engine/args.py's FLAGS) as a Typer option type: its spellings and help, ``note``
    after the help (what this command does with it), ``option`` passed to ``typer.Option`` (``show_default``...)."""
    flag = FLAGS[name]
    text = " ".join(t for t in (flag.help, note.strip()) if t)
    option.update({k: getattr(flag, k) for k in ("min", "max") if getattr(flag, k) is not None})
    return Annotated[Optional[flag.type], typer.Option(*flag.names, help=text, **option)]


def _shown(name: str, value) -> str:
    if isinstance(value, bool):
        on, _, off = FLAGS[name].names[0].partition("/")
        return on if value else off
    return str(value)


def _default_text(name: str, presets: dict[str, str | None]) -> str:
    """Where the command's default comes from: the engine's, or per machine the preset's."""
    values = {where: getattr(preset(p) if p else DEFAULTS, name) for where, p in presets.items()}
    if all(v is None for v in values.values()):         # unset: the flag's help says what happens
        return ""
    if len(set(map(repr, values.values()))) == 1:
        return f"Default: {_shown(name, next(iter(values.values())))}."
    return "Default: " + ", ".join(f"{_shown(name, v)} {where}" for where, v in values.items()) + "."


def engine_options(*names: str, presets: dict[str, str | None] | None = None, notes: dict[str, str] | None = None):
    """Decorator: the command takes the engine options ``names`` (engine/args.py's FLAGS) after its own, as
    Typer options, and receives those given on the command line as one dict, its parameter ``engine`` (an option
    left out is absent: the command's preset or the engine's default applies). ``presets`` says where that
    default comes from, for ``--help`` (``{"on CUDA": "serve-cuda", "on CPU": "practice"}``; None: the engine's
    own); ``notes`` adds a line of the command's own to an option's help."""
    presets = presets or {"": None}
    notes = notes or {}

    def wrap(command):
        hints = typing.get_type_hints(command, include_extras=True)
        sig = inspect.signature(command)
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()
               if p.name != "engine"]
        def option(n: str):
            note = " ".join(t for t in (notes.get(n), _default_text(n, presets)) if t)
            return engine_flag(n, note, show_default=False)

        added = [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=option(n))
                 for n in names]

        @functools.wraps(command)
        def run(*args, **kwargs):
            given = {n: kwargs.pop(n) for n in names if kwargs.get(n) is not None}
            kwargs.pop("engine", None)
            for n in names:
                kwargs.pop(n, None)
            return command(*args, engine=given, **kwargs)

        run.__signature__ = sig.replace(parameters=[*own, *added])
        run.__annotations__ = {p.name: p.annotation for p in (*own, *added)}
        del run.__wrapped__                  # Typer reads the signature above, not the command's
        return run

    return wrap


SeedOpt = Annotated[Optional[int], typer.Option("--seed", help="Random seed (what it seeds: see the command's description).")]

# engine options, one at a time (a command's own default after ``=``)
DeviceOpt = engine_flag("device")
AttentionOpt = engine_flag("attention_backend")
DtypeOpt = engine_flag("dtype")
KvCacheDtypeOpt = engine_flag("kv_cache_dtype")
MaxNumBatchedTokensOpt = engine_flag("max_num_batched_tokens")
MaxModelLenOpt = engine_flag("max_model_len")
EnforceEagerOpt = engine_flag("enforce_eager")
FusedOpsOpt = engine_flag("fused_ops")
TensorParallelSizeOpt = engine_flag("tensor_parallel_size")
KvCacheBlockSizeOpt = engine_flag("kvcache_block_size")
MaxConsecutivePrefillOpt = engine_flag("max_consecutive_prefill", show_default=False)
