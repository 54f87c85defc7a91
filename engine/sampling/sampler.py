"""The sampler: greedy at temperature 0, seeded temperature sampling otherwise, on the logits' device.

:class:`Sampler` is what the runner calls once per step: it owns the engine's generator, the per-request
generators of seeded requests and the penalty rows' token history, and sends each batch down the plain
path (:func:`sample_tensor`) or, when some row asks for more, :func:`sample_processed`.

Plain path. CUDA: one fused Triton pass (engine/sampling/gumbel_kernel.py, Gumbel-max keyed by per-row
seeds drawn from each row's generator). CPU: the exponential race in torch. Both draw exactly from
softmax(logits / T).

Rows under a grammar (SamplingParams.structured_outputs) first get their disallowed tokens set to -inf
(engine/sampling/structured.py: GrammarMask), in place, then take whichever path their other settings ask for.

Rows whose requests ask for more (top_p/top_k/min_p, penalties, logit_bias, min_tokens, logprobs) go
through :func:`sample_processed`: their logits pass the processors of engine/sampling/processors.py
and are then drawn by the same code at temperature 1 (the processors applied the temperature), each
with its own generator; the other rows of the batch take the plain path unchanged.
"""
from __future__ import annotations

import torch

from engine.sampling.logprobs import SampledLogprobs, logprobs_of
from engine.sampling.processors import RowInputs, TokenHistory, process, to_device
from engine.sampling.structured import GrammarMask

try:
    from engine.sampling.gumbel_kernel import gumbel_argmax
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
    temps = to_device([max(t, 1e-5) for t in temperatures], logits.device, torch.float32)
    probs = torch.softmax(logits.float() / temps.unsqueeze(1), dim=-1)
    noise = torch.empty_like(probs)
    groups = _rows_by_generator(generators)
    for gen, rows in groups:
        if len(rows) == len(generators):
            noise.exponential_(1.0, generator=gen)
        else:
            idx = to_device(rows, logits.device)
            noise[idx] = torch.empty(len(rows), probs.shape[1], device=logits.device).exponential_(1.0, generator=gen)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = to_device([t == 0 for t in temperatures], logits.device)
    return torch.where(is_greedy, greedy, sampled)


_last_temps: tuple[tuple, torch.Tensor] | None = None


def _device_temperatures(temperatures: list[float], device) -> torch.Tensor:
    """The temperatures as a device tensor; the last one is reused while the list is unchanged (steady decode).
    (Read-only: the sampling kernel does not write it.)"""
    global _last_temps
    key = (str(device), tuple(temperatures))
    if _last_temps is None or _last_temps[0] != key:
        t = to_device(temperatures, device, torch.float32)
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
            seeds[to_device(rows, device)] = draw(gen, len(rows))
    return gumbel_argmax(logits, temps, seeds)


def sample_processed(logits: torch.Tensor, temperatures: list[float], generators: list[torch.Generator],
                     rows: dict[int, RowInputs], logprobs_mode: str = "raw_logprobs",
                     history: TokenHistory | None = None) -> tuple[torch.Tensor, SampledLogprobs | None]:
    """Sample a batch in which `rows` (batch row -> its inputs) need processing; the others take the
    plain path. Returns the ids on the logits' device and the log-probs of the rows that asked for them."""
    dev = logits.device
    n = logits.shape[0]
    proc = sorted(rows)
    plain = [i for i in range(n) if i not in rows]
    out = torch.empty(n, dtype=torch.int64, device=dev)
    if plain:
        idx = to_device(plain, dev)
        ids = sample_tensor(logits.index_select(0, idx), [temperatures[i] for i in plain],
                            [generators[i] for i in plain])
        out.index_copy_(0, idx, ids.long())
    idx = to_device(proc, dev)
    raw = logits.index_select(0, idx)
    inputs = [rows[i] for i in proc]
    processed = process(raw, inputs, history)
    ids = sample_tensor(processed, [1.0 if temperatures[i] > 0 else 0.0 for i in proc],
                        [generators[i] for i in proc]).long()
    out.index_copy_(0, idx, ids)
    want = [j for j, r in enumerate(inputs) if r.params.logprobs is not None]
    if not want:
        return out, None
    sel = to_device(want, dev)
    src = processed if logprobs_mode == "processed_logprobs" else raw.float()
    lp = torch.log_softmax(src.index_select(0, sel), dim=-1)
    counts = [inputs[j].params.logprobs for j in want]
    chosen, ranks, top_ids, top_lps = logprobs_of(lp, ids.index_select(0, sel), max(counts))
    return out, SampledLogprobs([proc[j] for j in want], counts, chosen, ranks, top_ids, top_lps)


class Sampler:
    """Draws a step's tokens from its logits: the engine's generator (seeded once from the config's seed)
    for every request without a seed of its own, one generator per seeded request (made on its first draw,
    dropped by forget()), and the penalty rows' token counts (made on first use)."""

    def __init__(self, device: str, seed: int, eos_token_ids: tuple[int, ...] = (),
                 logprobs_mode: str = "raw_logprobs"):
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.logprobs_mode = logprobs_mode
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)
        self._seq_generators: dict[int, torch.Generator] = {}
        self._history: TokenHistory | None = None     # penalty rows' token counts
        self._mask: GrammarMask | None = None          # constrained rows' token bitmask (made on first use)

    def __call__(self, seqs: list, logits: torch.Tensor) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """The step's ids on the device, and the log-probs of the rows that asked for them. A batch in
        which no row needs processing takes exactly the plain path (sample_tensor)."""
        temps, gens, rows, masked = [], [], {}, []
        for i, seq in enumerate(seqs):          # one walk over the batch: temperature, generator, processing
            sp = seq.sampling_params
            temps.append(sp.temperature)
            if sp.seed is not None:
                gen = self._seq_generators.get(seq.seq_id)
                if gen is None:
                    gen = torch.Generator(device=self.device)
                    gen.manual_seed(sp.seed)
                    self._seq_generators[seq.seq_id] = gen
                gens.append(gen)
            else:
                gens.append(self.generator)
            if sp._plain:
                continue
            if sp.needs_processing(seq.num_completion_tokens):
                rows[i] = RowInputs(sp, seq.token_ids, seq.num_prompt_tokens, self.eos_token_ids, seq.seq_id)
            if seq.grammar is not None:
                masked.append((i, seq.grammar))
        if masked:                              # before either path reads the logits (greedy and log-probs too)
            if self._mask is None:
                self._mask = GrammarMask(logits.shape[1])
            self._mask.apply(logits, masked)
        if not rows:
            return sample_tensor(logits, temps, gens), None
        if self._history is None and any(r.params.has_penalties for r in rows.values()):
            self._history = TokenHistory(logits.shape[1], logits.device)
        return sample_processed(logits, temps, gens, rows, self.logprobs_mode, self._history)

    def forget(self, seq_id: int) -> None:
        """A finished or aborted sequence: its generator and its token counts go."""
        self._seq_generators.pop(seq_id, None)
        if self._history is not None:
            self._history.forget(seq_id)
