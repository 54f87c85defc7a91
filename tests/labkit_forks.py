"""``labkit`` commands on a copy of the repository, each in a process of its own, without each paying the import of
torch and transformers (about 9 CPU-s before a ``python -m labkit`` does anything).

A test that runs checkpoints' commands on mutated copies of the tree (tests/engine/test_mutations.py) needs a fresh
process per command: its ``engine`` and ``labkit`` must be the copy's. This file, run as a script once per module
(:class:`LabkitForks`), imports those third-party packages only (never ``engine``, ``labkit`` or a test module),
then forks one child per command. The child points its working directory, ``sys.path`` and environment at the
copy, runs ``python -m labkit ARGS`` there (runpy; stdin /dev/null, stdout and stderr in files, as ``labkit run``
starts a command) and exits with the command's exit code. Each child imports the copy's modules afresh and ends
with its command: nothing of one command reaches the next.

Protocol: one JSON line per command on the script's stdin, one JSON line ``{"code": N}`` back on its stdout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


class LabkitForks:
    """The forking process; ``run(root, *args, env=...)`` -> ``subprocess.CompletedProcess`` (returncode, stdout,
    stderr) of ``python -m labkit ARGS`` with ``root`` first on the path and as the working directory."""

    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}     # nothing of this tree imported
        self.proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env, cwd=tempfile.gettempdir())
        self.logs = Path(tempfile.mkdtemp(prefix="labkit-forks-"))
        self.count = 0

    def run(self, root: Path, *args: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
        self.count += 1
        out, err = self.logs / f"{self.count}.out", self.logs / f"{self.count}.err"
        job = {"root": str(root), "args": [str(a) for a in args], "env": {**os.environ, **(env or {})},
               "stdout": str(out), "stderr": str(err), "timeout": timeout}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the forking process ended (exit {self.proc.poll()})"
        return subprocess.CompletedProcess(["labkit", *job["args"]], json.loads(line)["code"],
                                           out.read_text(errors="replace"), err.read_text(errors="replace"))

    def close(self) -> None:
        import shutil

        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        shutil.rmtree(self.logs, ignore_errors=True)


#: The third-party modules a labkit command imports at its start (transformers' lazy ones named one by one).
PRELOAD = ("numpy", "pydantic", "rich.console", "safetensors.torch", "torch", "typer", "typer.rich_utils",
           "transformers", "transformers.models.auto.tokenization_auto", "transformers.models.auto.modeling_auto",
           "transformers.models.qwen3.modeling_qwen3")


def _preload() -> None:
    """Import PRELOAD (no torch op runs here: the children fork from a process with no threads)."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)


def _child(job: dict) -> None:
    """In the forked child: run the command, then exit with its code (never returns)."""
    import runpy
    import signal
    import traceback

    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        signal.alarm(job["timeout"])                   # past it the child dies of SIGALRM: returncode -14
        os.chdir(job["root"])
        os.environ.clear()
        os.environ.update(job["env"], PYTHONPATH=job["root"])
        sys.path.insert(0, job["root"])
        sys.argv = ["labkit", *job["args"]]
        runpy.run_module("labkit", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:                              # noqa: BLE001 (as an uncaught exception ends python: exit 1)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def main() -> None:
    import gc

    gc.disable()                    # the gc docs' recipe for fork without exec: no collection in this process,
    _preload()
    gc.freeze()                     # its objects frozen (a child's collections skip them: no copy-on-write of
    for line in sys.stdin:          # the whole preloaded heap, no time spent walking it), gc on in the child
        job = json.loads(line)
        pid = os.fork()
        if pid == 0:
            gc.enable()
            _child(job)
        _, status = os.waitpid(pid, 0)
        sys.stdout.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
