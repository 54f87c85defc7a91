"""Greedy at temperature 0, seeded temperature sampling otherwise (exponential-race trick)."""
from __future__ import annotations

import torch


def sample(logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator | None]) -> list[int]:
    greedy = logits.argmax(dim=-1)
    if all(t == 0 for t in temperatures):
        return greedy.tolist()
    temps = torch.tensor([max(t, 1e-5) for t in temperatures], device=logits.device, dtype=torch.float32)
    probs = torch.softmax(logits.float() / temps.unsqueeze(1), dim=-1)
    noise = torch.empty_like(probs)
    for i, gen in enumerate(generators):
        noise[i].exponential_(1.0, generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([t == 0 for t in temperatures], device=logits.device)
    return torch.where(is_greedy, greedy, sampled).tolist()
