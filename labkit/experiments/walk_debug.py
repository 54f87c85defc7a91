"""`labkit quick-walk --debug` (handbook 5.1.7): a pdb prompt after the engine is built, before any request.

The prompt's namespace holds the engine object as ``llm`` and the engine's modules under names that do not
clash with the package (``engine_pkg``, ``engine_module`` (the handbook's name for ``engine.llm_engine``),
``scheduler_mod``, ``block_manager_mod``, ...), and the banner
suggests one breakpoint per lesson of docs/COURSE.md, its line computed from the source (never typed in) and
its file an absolute path read from the imported module, so ``b`` finds it however labkit was started (the
installed console script puts its own directory, not the working directory, first on sys.path, where pdb
looks for a relative file name).
``q`` ends the command with exit 0 (labkit's root group maps pdb's BdbQuit to a clean exit).

The modules are imported by name (importlib) on purpose: this namespace is for a person reading the
engine's internals in a debugger; no labkit code path calls into them (tests/lab/test_layout.py's rule).
"""
from __future__ import annotations

import ast
import importlib
import inspect
import os
import sys
import textwrap

# the names the prompt offers: name -> module (the backend's module is added from the engine's choice)
MODULES = {
    "engine_pkg": "engine",
    "engine_module": "engine.llm_engine",      # handbook 5.1.7's name: `b engine_module.LLMEngine.step`
    "sequence_mod": "engine.sequence",
    "scheduler_mod": "engine.scheduler",
    "block_manager_mod": "engine.block_manager",
    "step_inputs_mod": "engine.step_inputs",
    "model_runner_mod": "engine.model_runner",
    "metadata_mod": "engine.attention.metadata",
    "qwen3_mod": "engine.models.qwen3",
    "graph_mod": "engine.graph",
    "tp_workers_mod": "engine.tp_workers",
}
BACKEND_MODULES = {"torch": "engine.attention.torch_backend", "triton": "engine.attention.triton_backend",
                   "flash_attn": "engine.attention.flash_backend"}

# one breakpoint per lesson of docs/COURSE.md: (lesson, module, qualified name)
LESSON_BREAKPOINTS = (
    (1, "engine.llm_engine", "LLMEngine.step"),
    (2, "engine.sequence", "Sequence.append_token"),
    (3, "engine.scheduler", "Scheduler.schedule"),
    (4, "engine.block_manager", "BlockManager.allocate"),
    (5, "engine.step_inputs", "InputBuilder.plan_prefill"),
    (6, "engine.step_inputs", "InputBuilder.plan_decode"),
    (7, "engine.models.qwen3", "Attention.forward"),
    (8, "engine.model_runner", "ModelRunner.run_model"),
)
# a pdb condition per lesson where an unconditional stop would miss the point: lesson 4 stops only when
# allocate is handed prefix hits (the scheduler passes the hits cached_prefix found; [] is no hit)
CONDITIONS = {4: "hits"}
WHY = {4: "stops only on a prefix hit, e.g. B's in --case prefix"}


def first_body_line(fn) -> int:
    """The line of fn's first statement after its docstring: where `b FILE:LINE` stops on every call."""
    lines, start = inspect.getsourcelines(fn)
    node = ast.parse(textwrap.dedent("".join(lines))).body[0]
    body = node.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        body = body[1:]
    return start + body[0].lineno - 1


def lesson_breakpoints() -> list[dict]:
    """[{lesson, target, file, line, condition, command}] for LESSON_BREAKPOINTS, read from the source now;
    ``file`` is the absolute path of the module Python imported (pdb's ``b`` resolves it from any directory)."""
    out = []
    for lesson, module, qualname in LESSON_BREAKPOINTS:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        obj = inspect.unwrap(obj)                  # through decorators (torch.inference_mode)
        path = os.path.abspath(inspect.getsourcefile(obj))
        line = first_body_line(obj)
        cond = CONDITIONS.get(lesson)
        out.append({"lesson": lesson, "target": f"{module}:{qualname}", "file": path, "line": line,
                    "condition": cond, "command": f"b {path}:{line}" + (f", {cond}" if cond else "")})
    return out


def banner(names: dict[str, object]) -> str:
    mods = textwrap.fill(", ".join(f"{k}={v.__name__}" for k, v in names.items() if k != "llm"), width=100,
                         initial_indent="  modules: ", subsequent_indent="    ")
    bps = lesson_breakpoints()
    width = max(len(b["command"]) for b in bps)
    rows = "\n".join(f"  {b['command']:<{width}}  # lesson {b['lesson']}: {b['target'].split(':')[1]}"
                     + (f" ({WHY[b['lesson']]})" if b["lesson"] in WHY else "") for b in bps)
    return ("debug: engine built and warmed up, no request added yet.\n"
            "  llm = the LLMEngine (llm.scheduler, llm.block_manager, llm.runner)\n"
            f"{mods}\n"
            f"one breakpoint per lesson (docs/COURSE.md; the module form works too: b scheduler_mod.Scheduler.schedule):\n{rows}\n"
            "then `c` runs the walk to the next breakpoint; `q` quits (exit 0, no evidence written)")


def debug_prompt(llm) -> None:
    """Stop in pdb with `llm` and the engine's modules in scope; returns when the learner continues."""
    import pdb

    backend = BACKEND_MODULES.get(llm.describe()["attention_backend"])
    names: dict[str, object] = {"llm": llm}
    names.update({k: importlib.import_module(m) for k, m in MODULES.items()})
    if backend:
        names["backend_mod"] = importlib.import_module(backend)
    print(banner(names), file=sys.stderr, flush=True)
    # the prompt's frame: a function whose globals are exactly these names (pdb evaluates in them)
    scope = {**names, "__pdb__": pdb.Pdb(), "__name__": "labkit_debug"}
    exec(compile("def walk_debug():\n    __pdb__.set_trace()\n    return  # c: run the walk; q: quit\n",
                 "<labkit quick-walk --debug>", "exec"), scope)
    scope["walk_debug"]()
