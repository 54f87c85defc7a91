"""Greedy at temperature 0, seeded temperature sampling otherwise (exponential-race trick), on the logits' device."""
from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator]) -> list[int]:
    greedy = logits.argmax(dim=-1)
    if all(t == 0 for t in temperatures):
        return greedy.tolist()
    temps = torch.tensor([max(t, 1e-5) for t in temperatures], dtype=torch.float32).to(logits.device, non_blocking=True)
    probs = torch.softmax(logits.float() / temps.unsqueeze(1), dim=-1)
    noise = torch.empty_like(probs)
    # one draw per generator: rows sharing the engine's generator are filled in one call
    rows_by_gen: dict[int, tuple[torch.Generator, list[int]]] = {}
    for i, gen in enumerate(generators):
        rows_by_gen.setdefault(id(gen), (gen, []))[1].append(i)
    for gen, rows in rows_by_gen.values():
        if len(rows) == len(generators):
            noise.exponential_(1.0, generator=gen)
        else:
            idx = torch.tensor(rows, device=logits.device)
            noise[idx] = torch.empty(len(rows), probs.shape[1], device=logits.device).exponential_(1.0, generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([t == 0 for t in temperatures]).to(logits.device, non_blocking=True)
    return torch.where(is_greedy, greedy, sampled).tolist()
