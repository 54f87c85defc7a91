"""The one way the lab starts ``labkit serve`` in a process of its own: :class:`ServerProcess`.

The server is started on 127.0.0.1 with ``--port 0`` (it picks a free port and prints ``ready: URL`` once it
serves); its stdout and stderr go to one file, read for that line. The serve bench, the rate sweep's
``--serve-process`` and the served deployments of ``labkit scheduler compare`` all start their servers here.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from labkit.errors import UserError

SERVER_START_S = 600.0
READY_LINE = re.compile(r"ready: (http://127\.0\.0\.1:\d+)")


@dataclass
class ServerProcess:
    """A ``labkit serve`` subprocess on 127.0.0.1; ``url`` is set once it is ready."""
    proc: subprocess.Popen
    output: Path
    log: Path | None = None
    url: str | None = None

    @classmethod
    def spawn(cls, args: list[str] | tuple[str, ...], output: Path, log: Path | None = None,
              env: dict | None = None) -> "ServerProcess":
        """``labkit serve --port 0 ARGS``, its output to ``output``; returns at once (see :meth:`wait_ready`).
        ``log``: the event log the server was told to write (``--out``), kept for the caller."""
        output.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "labkit", "serve", "--port", "0", *args]
        with output.open("w") as sink:
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
                                    env={**os.environ, "COLUMNS": "200", **(env or {})})
        return cls(proc, output, log)

    def wait_ready(self, timeout_s: float = SERVER_START_S) -> "ServerProcess":
        """Wait for the server's ``ready: URL`` line; a server that exits first, or never says it, is a UserError."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = READY_LINE.search(self.output.read_text(errors="replace"))
            if m:
                self.url = m.group(1)
                return self
            if self.proc.poll() is not None:
                raise UserError(f"labkit serve exited with code {self.proc.returncode} before it was ready: "
                                f"{last_line(self.output)}")
            time.sleep(0.2)
        self.proc.kill()
        self.proc.wait()
        raise UserError(f"labkit serve was not ready within {timeout_s:g} s (its output: {self.output})")

    @classmethod
    def start(cls, model_dir: str, device: str, attention: str, settings: dict, log: Path, output: Path,
              timeout_s: float = SERVER_START_S, engine_process: bool = False,
              extra_args: tuple[str, ...] = ()) -> "ServerProcess":
        """A server with the bench's engine ``settings`` (max_num_seqs, max_num_batched_tokens, max_model_len,
        gpu_memory_utilization, enforce_eager, overlap), writing its event log to ``log``; ready when it returns."""
        args = ["--model", model_dir, "--device", device,
                "--attention", attention, "--max-num-seqs", str(settings["max_num_seqs"]),
                "--max-active", str(settings["max_num_seqs"]), "--queue-size", "1024",
                "--max-num-batched-tokens", str(settings["max_num_batched_tokens"]),
                "--max-model-len", str(settings["max_model_len"]),
                "--gpu-memory-utilization", str(settings["gpu_memory_utilization"]),
                "--enforce-eager" if settings["enforce_eager"] else "--graph",
                "--overlap" if settings.get("overlap") else "--no-overlap",
                "--out", str(log), "--log-level", "warning", "--stats-interval", "0",
                "--engine-process" if engine_process else "--no-engine-process", *extra_args]
        return cls.spawn(args, output, log).wait_ready(timeout_s)

    def served_config(self, worker_id: str) -> dict:
        """The server's ``/config``, after ``/health`` says it is ``worker_id``'s (not a stale server's)."""
        with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
            health = json.load(r)
        if health.get("worker_id") != worker_id:
            raise UserError(f"{self.url} is served by {health.get('worker_id')!r}, not {worker_id!r}: a stale server?")
        with urllib.request.urlopen(self.url + "/config", timeout=5) as r:
            return json.load(r)

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGINT (the server closes its worker and its log), then a kill after ``timeout_s``; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def last_line(path: Path) -> str:
    lines = [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    return lines[-1] if lines else "(no output)"
