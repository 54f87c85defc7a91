"""The overlapped step: launch step k+1 before reading step k's tokens, so the host's bookkeeping for step k runs
while the GPU computes k+1 (``EngineArgs.overlap``, CUDA, tensor-parallel-size 1).

``LLMEngine.step`` takes ``_step_overlapped`` when the engine overlaps. A launched step is an :class:`InFlight`:
its sampled ids stay on the device, and the next step's decode rows read them there (:func:`feed`). What may be
launched behind a step in flight is the scheduler's lookahead (``Scheduler.schedule_lookahead``), and, with a
prefill in flight and nothing behind it, the prefill of requests the host admits meanwhile (``_admit_behind``,
LAB_ADMIT_IN_FLIGHT in engine/levers.py)."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from engine.model_runner import Launched
from engine.sampling.processors import to_device
from engine.scheduler import StepOutcome
from engine.sequence import Sequence
from engine.step_output import StepOutput, step_kind

ADMIT_POLL_S = 0.0001        # LAB_ADMIT_IN_FLIGHT: how often the owner asks for arrivals while a prefill computes


@dataclass
class InFlight:
    """A launched step whose sampled ids are still on the device."""
    step: int
    seqs: list[Sequence]
    is_prefill: bool
    tokens: Launched
    scheduled: list[tuple[int, int]]             # (seq_id, positions computed), read when launched
    kind: str = ""                               # decode | prefill | mixed
    ahead: bool = False                          # launched behind a step in flight (StepOutput.ahead)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def feed(prev: InFlight, nxt: list[Sequence]) -> torch.Tensor:
    """The next step's input ids on the device: prev's sampled ids, in nxt's order, without a blocking
    copy (one would wait for the step in flight and leave the GPU idle while the host prepares the next)."""
    ids = prev.tokens.device_ids
    if len(nxt) == len(prev.seqs) and all(a is b for a, b in zip(nxt, prev.seqs)):
        return ids                                   # the steady decode: same batch, same order
    row_of = {s.seq_id: i for i, s in enumerate(prev.seqs)}
    return ids.index_select(0, to_device([row_of[s.seq_id] for s in nxt], ids.device))


class OverlappedSteps:
    """LLMEngine's overlapped step (a mixin: it reads the engine's scheduler, runner, ``_inflight``, ``arrivals``
    and ``admit_in_flight``, and calls its ``_schedule_step``, ``postprocess`` and ``_keep_logprobs``)."""

    def _launch(self, seqs: list[Sequence], is_prefill: bool, batch: list[tuple[int, int]],
                fed: torch.Tensor | None = None) -> InFlight:
        step, kind = self.num_steps, step_kind(seqs, is_prefill)
        return InFlight(step, seqs, is_prefill, self.runner.launch(seqs, is_prefill, fed, step), batch, kind)

    def _launch_behind(self, prev: InFlight) -> InFlight | None:
        """The lookahead's step behind ``prev`` (Scheduler.schedule_lookahead), launched, or None when it takes none."""
        nxt, is_prefill, batch = self._schedule_step(after=prev.seqs, after_prefill=prev.is_prefill)
        if not nxt:
            return None
        decodes = [s for s in nxt if s.decoding]
        if prev.is_prefill and not self.scheduler.mixed:   # a decode behind a prefill: the device feeds
            in_prev = {s.seq_id for s in prev.seqs}         # the prefill's rows, which lead the batch
            decodes = list(itertools.takewhile(lambda s: s.seq_id in in_prev, decodes))
        fed = feed(prev, decodes) if decodes else None
        flight = self._launch(nxt, is_prefill, batch, fed)
        flight.ahead = True
        return flight

    def _admit_behind(self, prev: InFlight) -> InFlight | None:
        """LAB_ADMIT_IN_FLIGHT (the default), a prefill in flight with nothing behind it: until the GPU ends it, ask
        the host for requests that arrived meanwhile (``arrivals``) and launch their prefill behind it (as the
        lookahead would have, had they been waiting); None when it ends first. Off CUDA a step has ended once
        launched."""
        ready = prev.tokens.ready
        while ready is not None and not ready.query():
            if self.arrivals():
                flight = self._launch_behind(prev)
                if flight is not None:
                    return flight
            time.sleep(ADMIT_POLL_S)
        return None

    def _step_overlapped(self) -> StepOutput:
        """step() with steps overlapped: launch step k+1 (its decode rows' input ids fed on the device from
        step k's samples) before reading step k's tokens, so the host's bookkeeping for k runs while the
        GPU computes k+1. Returns step k's output; one step may stay in flight between calls. With mixed
        batches step k+1 may also admit prefill chunks, and step k may itself have prefilled; in
        nano-vllm's step model only decode steps overlap, and with LAB_PREFILL_AHEAD (prefill, 1 or prefills) a
        decode step k may have the waiting requests' prefill as its step k+1, (1) a prefill step k the decode after
        it, and (prefills) a prefill step k the waiting requests' prefill, and (LAB_ADMIT_IN_FLIGHT, on by default)
        also the prefill of requests that arrive while prefill step k computes (_admit_behind).
        Any step the lookahead cannot take (see Scheduler.schedule_lookahead) runs one by one as in step()."""
        t0 = time.perf_counter()
        prev = self._inflight
        self._inflight = None
        if prev is None:
            seqs, is_prefill, batch = self._schedule_step()
            if not seqs:
                return StepOutput(self.num_steps, is_prefill, [], StepOutcome(), 0)
            prev = self._launch(seqs, is_prefill, batch)
        sched = self.scheduler
        if (sched.mixed or not prev.is_prefill or sched.decode_behind_prefill or sched.prefill_behind_prefill) and \
                not any(s.sampling_params.needs_history(s.num_completion_tokens) for s in prev.seqs):
            # (penalties, min_tokens and a grammar's mask read the token still in flight: those batches run
            # one by one; the other requests of such a batch keep going, one step per call)
            self._inflight = self._launch_behind(prev)
            if self._inflight is None and prev.is_prefill and self.admit_in_flight and self.arrivals is not None:
                self._inflight = self._admit_behind(prev)
        t_wait = time.perf_counter()
        token_ids = prev.tokens.tolist()
        wait_s = time.perf_counter() - t_wait
        row_logprobs = prev.tokens.host_logprobs(token_ids)
        live = [(s, t) for s, t in zip(prev.seqs, token_ids) if not s.is_finished]   # aborted meanwhile
        outcome = self.postprocess([s for s, _ in live], [t for _, t in live], prev.is_prefill, prev.step)
        kept = self._keep_logprobs(prev.seqs, row_logprobs, outcome)
        if self._inflight is not None:
            for s in self._inflight.seqs:
                if not s.is_finished and s.decoding:
                    s.num_scheduled_tokens = 1       # postprocess cleared it; the in-flight step computes 1
        return StepOutput(prev.step, prev.is_prefill, prev.seqs, outcome, prev.num_tokens,
                          time.perf_counter() - t0, prev.scheduled, prev.tokens.route, kept, wait_s,
                          prev.tokens.device_span(), prev.kind, prev.ahead)
