"""Rank 0 of a tensor-parallel engine and its handle on ranks 1..N-1.

Rank 0 lives in the caller's process and runs the scheduler; ranks 1..N-1 are spawned processes that
replay every forward rank 0 announces through a shared-memory step channel named for this instance.
"""
from __future__ import annotations

import atexit
import os
import pickle
import socket
import threading
import time
import uuid
from multiprocessing import shared_memory

import torch

from engine.config import ConfigError
from engine.distributed import ParallelContext, make_group
from engine.model_runner import ModelRunner


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_dist_init(dist_init: str | None) -> tuple[str, int]:
    """tcp://HOST:PORT, or a fresh free port on 127.0.0.1 when None."""
    if not dist_init:
        return "127.0.0.1", free_port()
    if not dist_init.startswith("tcp://") or ":" not in dist_init[6:]:
        raise ConfigError(f"dist_init must look like tcp://127.0.0.1:29501, got {dist_init!r}")
    host, port = dist_init[6:].rsplit(":", 1)
    return host, int(port)


class StepChannel:
    """Rank 0 writes one pickled message into named shared memory; workers read it after their event fires."""

    SIZE = 64 << 20

    def __init__(self, name: str, create: bool):
        self.name = name
        self.shm = shared_memory.SharedMemory(name=name, create=create, size=self.SIZE if create else 0)
        self.owner = create

    def write(self, obj) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) + 8 > self.SIZE:
            raise RuntimeError(f"step message of {len(data)} bytes exceeds the {self.SIZE}-byte channel")
        self.shm.buf[:8] = len(data).to_bytes(8, "little")
        self.shm.buf[8:8 + len(data)] = data

    def read(self):
        n = int.from_bytes(self.shm.buf[:8], "little")
        return pickle.loads(self.shm.buf[8:8 + n])

    def close(self) -> None:
        try:
            self.shm.close()
            if self.owner:
                self.shm.unlink()
        except FileNotFoundError:
            pass


def _worker_main(config, rank: int, world: int, host: str, port: int, shm_name: str, event, backend: str) -> None:
    """Rank > 0: build this rank's runner, then replay every step rank 0 announces until told to exit."""
    if backend == "nccl":
        torch.cuda.set_device(rank)
    group, store = make_group(backend, host, port, rank, world, config.tp_timeout_s)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    tp = ParallelContext(rank, world, group, device, store)
    runner = ModelRunner(config, tp=tp, device=device)
    channel = StepChannel(shm_name, create=False)
    parent = os.getppid()
    try:
        while True:
            if not event.wait(timeout=1.0):
                if os.getppid() != parent:      # rank 0's process is gone: do not linger
                    return
                continue
            event.clear()
            method, payload = channel.read()
            if method == "exit":
                return
            if method == "run":
                runner.run_model(runner.inputs.to_inputs(payload))
    finally:
        channel.close()
        runner.close()


class TPWorkers:
    """Rank 0's handle on ranks 1..N-1: spawn, announce steps, detect death, exit once."""

    def __init__(self, config, backend: str):
        import multiprocessing as mp

        self.world = config.tensor_parallel_size
        self.host, self.port = parse_dist_init(config.dist_init)
        self.shm_name = config.shm_name or f"labkit_tp_{os.getpid()}_{uuid.uuid4().hex[:10]}"
        self.channel = StepChannel(self.shm_name, create=True)
        ctx = mp.get_context("spawn")
        self.events = [ctx.Event() for _ in range(1, self.world)]
        self.procs = [ctx.Process(target=_worker_main, daemon=True, name=f"engine-tp-rank{r}",
                                  args=(config, r, self.world, self.host, self.port, self.shm_name, ev, backend))
                      for r, ev in zip(range(1, self.world), self.events)]
        try:
            for p in self.procs:
                p.start()
        except BaseException:       # e.g. spawn refusing to start from a rank still bootstrapping: no leaked channel
            for p in self.procs:
                if p.pid is not None:
                    p.terminate()
            self.channel.close()
            raise
        self._closed = False
        atexit.register(self.close)

    @property
    def dist_init(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def check_alive(self, joining: bool = False) -> None:
        """Raise if a rank has exited. joining: rank 0 is still waiting for the ranks to join, and the message
        names the usual cause (ranks start with spawn, which re-runs the caller's main module)."""
        for rank, p in enumerate(self.procs, start=1):
            if p.is_alive():
                continue
            why = (" before it joined rank 0 (its own error is above). Ranks start with multiprocessing's spawn, "
                   "which re-runs the main script: a script that builds a tensor-parallel engine needs its code "
                   "under `if __name__ == \"__main__\":`") if joining else "; the engine cannot continue"
            raise RuntimeError(f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}{why}")

    def send(self, method: str, payload=None) -> None:
        self.check_alive()
        self.channel.write((method, payload))
        for ev in self.events:
            ev.set()

    def _wake_ranks(self, timeout_s: float) -> None:
        """Set every rank's event, bounded: Event.set() waits for each waiter to wake, and a rank killed while
        it waited (a process-group SIGTERM) never does; the close then goes on (join, terminate, unlink)."""
        t = threading.Thread(target=lambda: [ev.set() for ev in self.events], name="engine-tp-wake", daemon=True)
        t.start()
        t.join(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if any(p.is_alive() for p in self.procs):
                self.channel.write(("exit", None))
                self._wake_ranks(2.0)
            deadline = time.monotonic() + timeout_s
            for p in self.procs:
                p.join(max(0.1, deadline - time.monotonic()))
                if p.is_alive():
                    p.terminate()
                    p.join(2.0)
        finally:
            self.channel.close()
            atexit.unregister(self.close)


def start_rank0(config, device: str) -> tuple[ParallelContext, TPWorkers]:
    """Spawn ranks 1..N-1, then join the group as rank 0 (blocks until every rank has joined)."""
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl" and torch.cuda.device_count() < config.tensor_parallel_size:
        raise ConfigError(f"tensor_parallel_size {config.tensor_parallel_size} needs that many GPUs; "
                         f"this machine has {torch.cuda.device_count()}")
    workers = TPWorkers(config, backend)
    try:
        group, store = make_group(backend, workers.host, workers.port, 0, workers.world, config.tp_timeout_s,
                                  waiting=lambda: workers.check_alive(joining=True))
    except Exception:
        workers.close()
        raise
    return ParallelContext(0, workers.world, group, "cuda:0" if backend == "nccl" else "cpu", store), workers
