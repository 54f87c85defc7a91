"""Tensor parallelism for one engine instance: the collectives the layers call.

Each engine instance owns its process group (made from its own TCP store address; no default process
group is used), so two engines never collide on one machine, nor two in one process. NCCL on CUDA, gloo
on CPU. How the ranks are started and fed is in engine/tp_workers.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist


@dataclass
class ParallelContext:
    rank: int = 0
    world_size: int = 1
    group: object | None = None       # a ProcessGroup object owned by this engine instance
    device: str = "cpu"               # where collective buffers live (cuda for NCCL)
    store: object | None = None       # the TCP store the group was made from (kept alive with it)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            self.group.allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def min_int(self, value: int) -> int:
        """The smallest value across ranks (ranks agree on the KV pool size)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([t], opts).wait()
        return int(t.item())


SINGLE = ParallelContext()


JOINED = "labkit_ranks_joined"       # the store's count of ranks 1..N-1 that have connected to it


def make_group(backend: str, host: str, port: int, rank: int, world: int, timeout_s: float,
               waiting: Callable[[], None] | None = None):
    """This rank's process group, made from a TCP store at host:port that rank 0 serves. Rank 0 first waits
    for the other ranks to connect to the store, calling ``waiting()`` between polls (it raises to stop the
    wait: a rank that exited before it joined), and gives up after timeout_s."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world, is_master=(rank == 0), timeout=timeout, wait_for_workers=False)
    if rank == 0:
        deadline = time.monotonic() + timeout_s
        while store.add(JOINED, 0) < world - 1:
            if waiting is not None:
                waiting()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel ranks did not join rank 0 at {host}:{port} within {timeout_s:g} s "
                                   f"({store.add(JOINED, 0)} of {world - 1})")
            time.sleep(0.05)
    else:
        store.add(JOINED, 1)
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world, dist.ProcessGroupNCCL.Options()), store
    return dist.ProcessGroupGloo(store, rank, world, timeout), store
