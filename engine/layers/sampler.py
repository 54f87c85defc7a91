"""Greedy at temperature 0, seeded temperature sampling otherwise, on the logits' device.

CUDA: one fused Triton pass (engine/layers/sample_kernel.py, Gumbel-max keyed by per-row seeds drawn
from each row's generator). CPU: the exponential race in torch. Both draw exactly from softmax(logits / T).
"""
from __future__ import annotations

import torch

try:
    from engine.layers.sample_kernel import gumbel_argmax
except ImportError:            # no triton (CPU machines)
    gumbel_argmax = None


def _rows_by_generator(generators: list[torch.Generator]) -> list[tuple[torch.Generator, list[int]]]:
    """Rows sharing a generator are drawn for in one call, in row order."""
    groups: dict[int, tuple[torch.Generator, list[int]]] = {}
    for i, gen in enumerate(generators):
        groups.setdefault(id(gen), (gen, []))[1].append(i)
    return list(groups.values())


def sample(logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator]) -> list[int]:
    return sample_tensor(logits, temperatures, generators).tolist()


def sample_tensor(logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator]) -> torch.Tensor:
    """The sampled ids as a tensor on the logits' device (no host sync)."""
    if logits.is_cuda and gumbel_argmax is not None:
        return _sample_fused(logits, temperatures, generators)
    greedy = logits.argmax(dim=-1)
    if all(t == 0 for t in temperatures):
        return greedy
    temps = torch.tensor([max(t, 1e-5) for t in temperatures], dtype=torch.float32).to(logits.device, non_blocking=True)
    probs = torch.softmax(logits.float() / temps.unsqueeze(1), dim=-1)
    noise = torch.empty_like(probs)
    groups = _rows_by_generator(generators)
    for gen, rows in groups:
        if len(rows) == len(generators):
            noise.exponential_(1.0, generator=gen)
        else:
            idx = torch.tensor(rows, device=logits.device)
            noise[idx] = torch.empty(len(rows), probs.shape[1], device=logits.device).exponential_(1.0, generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([t == 0 for t in temperatures]).to(logits.device, non_blocking=True)
    return torch.where(is_greedy, greedy, sampled)


_last_temps: tuple[tuple, torch.Tensor] | None = None


def _device_temperatures(temperatures: list[float], device) -> torch.Tensor:
    """The temperatures as a device tensor; the last one is reused while the list is unchanged (steady decode).
    (Read-only: the sampling kernel does not write it.)"""
    global _last_temps
    key = (str(device), tuple(temperatures))
    if _last_temps is None or _last_temps[0] != key:
        t = torch.tensor(temperatures, dtype=torch.float32, pin_memory=True).to(device, non_blocking=True)
        _last_temps = (key, t)
    return _last_temps[1]


def _sample_fused(logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator]) -> torch.Tensor:
    device = logits.device
    n = len(temperatures)
    temps = _device_temperatures(temperatures, device)
    draw = lambda gen, k: torch.randint(0, 2**31 - 1, (k,), generator=gen, device=device)  # noqa: E731
    if all(t == 0 for t in temperatures):
        seeds = torch.zeros(n, dtype=torch.int64, device=device)
    elif all(g is generators[0] for g in generators):      # the common case: the engine's generator only
        seeds = draw(generators[0], n)
    else:
        seeds = torch.empty(n, dtype=torch.int64, device=device)
        for gen, rows in _rows_by_generator(generators):
            seeds[torch.tensor(rows, device=device)] = draw(gen, len(rows))
    return gumbel_argmax(logits, temps, seeds)
