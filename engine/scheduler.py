"""Chooses each step's work under one token budget, in one of two step models.

Mixed (``mixed_batches``, vLLM v1's step): the running decodes first, one token each, preempting the newest
running request when the pool is full; then prefill chunks of waiting (or partially prefilled) requests in
what is left of the budget, the last of them possibly cut into a chunk. nano-vllm's step model (the
default until a run says otherwise): each step is all-prefill (chunked under the budget) or all-decode.
Either way a step's rows are (sequence, positions it computes) and the runner plans them in this order."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import SchedulerLimits
from engine.sequence import Sequence, SequenceStatus


@dataclass
class StepOutcome:
    """What postprocess did: accepted candidates, discarded chunk candidates, finished seqs, freed blocks."""
    accepted: dict[int, int] = field(default_factory=dict)
    discarded: list[int] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    freed_blocks: list[int] = field(default_factory=list)


class Scheduler:
    def __init__(self, limits: SchedulerLimits, block_manager: BlockManager):
        self.max_num_seqs = limits.max_num_seqs
        self.max_num_batched_tokens = limits.max_num_batched_tokens
        self.max_model_len = limits.max_model_len
        self.policy = limits.scheduling_policy
        self.mixed = limits.mixed_batches
        self.eos = set(limits.eos_token_ids)
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        # prefill steps in a row at most while decodes wait: the knob, else the policy's own rule
        # (balanced alternates: 1; prefill_first runs any runnable prefill first: no limit)
        knob = limits.max_consecutive_prefill
        self.max_consecutive_prefill = knob if knob is not None else (1 if self.policy == "balanced" else None)
        self._prefill_run = 0                      # prefill steps since the last decode step
        # totals for the service's metrics (vLLM's num_preemptions, prefix_cache_queries / hits, in tokens)
        self.num_preemptions = self.prefix_queries = self.prefix_hits = 0
        # nano-vllm's step model with the overlapped decode: the prefill of requests waiting behind a decode in
        # flight is launched as the next step, before that decode's tokens are read (prefill_ahead), and the decode
        # after a prefill behind it (decode_behind_prefill), or the prefill of requests waiting behind a prefill in
        # flight (prefill_behind_prefill); LLMEngine sets them from LAB_PREFILL_AHEAD (default: the first and the
        # third; a scheduler built on its own has none, and each step waits for the tokens in flight)
        self.prefill_ahead = False
        self.decode_behind_prefill = False
        self.prefill_behind_prefill = False

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    # -- selection -----------------------------------------------------------
    def schedule(self) -> tuple[list[Sequence], bool]:
        """The step's sequences (decodes first in a mixed step) and whether any of them prefills."""
        if self.mixed:
            return self._schedule_mixed()
        if self._prefill_capped() and self.running:
            order = (False, True)          # enough prefills in a row: decode gets this turn
        else:
            order = (True, False)
        for is_prefill in order:
            seqs = self._schedule_prefill() if is_prefill else self._schedule_decode()
            if seqs:
                self._prefill_run = self._prefill_run + 1 if is_prefill else 0
                return seqs, is_prefill
        self._check_schedulable([])
        return [], False

    def _check_schedulable(self, seqs: list[Sequence]) -> None:
        """A step that schedules nothing while requests wait: the KV pool cannot hold the first of them."""
        if not seqs and self.waiting:
            raise RuntimeError(f"cannot schedule request {self.waiting[0].seq_id}: the KV pool "
                               f"({self.block_manager.num_blocks} blocks) cannot hold it")

    def _schedule_mixed(self) -> tuple[list[Sequence], bool]:
        """Decodes first (each one token of the budget), then prefill chunks in what is left. A step that
        had to preempt admits no prefill: the blocks it freed go to the running requests, not back to the
        request just sent to wait."""
        preempted = self.num_preemptions
        decodes = self._schedule_decode(budget=self.max_num_batched_tokens)
        prefills: list[Sequence] = []
        if self.num_preemptions == preempted:
            prefills = self._schedule_prefill(budget=self.max_num_batched_tokens - len(decodes),
                                              seats=self.max_num_seqs - len(decodes), chunk_any=True)
        seqs = decodes + prefills
        self._check_schedulable(seqs)
        return seqs, bool(prefills)

    def _schedule_prefill(self, budget: int | None = None, seats: int | None = None,
                          chunk_any: bool = False) -> list[Sequence]:
        """Prefill rows from the head of waiting under `budget` tokens and `seats` sequences. chunk_any
        (mixed steps): the last admitted request may be cut into a chunk wherever it stands in the batch;
        otherwise only the first sequence of a batch may be chunked (nano-vllm's rule)."""
        scheduled: list[Sequence] = []
        budget = self.max_num_batched_tokens if budget is None else budget
        seats = self.max_num_seqs if seats is None else seats
        bm = self.block_manager
        while self.waiting and len(scheduled) < seats and budget > 0:
            seq = self.waiting[0]
            if seq.waits_for_sibling:
                break                      # n > 1: its sibling's prefill fills the prefix cache first
            if not seq.block_table:
                # prompt log-probs need every prompt position computed: no prefix-cache hits for them
                hits = [] if not seq.prompt_logprobs_done else bm.cached_prefix(seq)   # one hash walk per admission
                remaining = seq.num_tokens - len(hits) * bm.block_size
                if scheduled and remaining > budget and not chunk_any:
                    break                  # only the first sequence of a batch may be chunked
                if not bm.can_allocate(seq, hits):
                    break
                bm.allocate(seq, hits)
                self.prefix_queries += seq.num_tokens
                self.prefix_hits += len(hits) * bm.block_size
            remaining = seq.num_tokens - seq.num_cached_tokens
            if scheduled and remaining > budget and not chunk_any:
                break
            seq.num_scheduled_tokens = min(remaining, budget)
            seq.decoding = False
            budget -= seq.num_scheduled_tokens
            scheduled.append(seq)
            if seq.num_scheduled_tokens < remaining:
                break                      # a chunk: it stays first in waiting for the next round
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return scheduled

    def _schedule_decode(self, budget: int | None = None) -> list[Sequence]:
        """One token for each running sequence (at most max_num_seqs, and `budget` tokens in a mixed step);
        a sequence that cannot get a block preempts the newest running one (the tail), or itself."""
        scheduled: list[Sequence] = []
        cap = self.max_num_seqs if budget is None else min(self.max_num_seqs, budget)
        while self.running and len(scheduled) < cap:
            seq = self.running.popleft()
            while not self.block_manager.can_append(seq):
                if self.running:
                    self.preempt(self.running.pop())   # the running tail gives its blocks back
                else:
                    self.preempt(seq)
                    break
            else:
                self.block_manager.may_append(seq)
                seq.num_scheduled_tokens = 1
                seq.decoding = True
                scheduled.append(seq)
        if self.policy == "balanced":
            self.running.extend(scheduled)             # served requests go to the back
        else:
            self.running.extendleft(reversed(scheduled))
        return scheduled

    def schedule_lookahead(self, inflight: list[Sequence],
                           inflight_prefill: bool = False) -> tuple[list[Sequence], bool]:
        """The step after `inflight` (a step whose tokens are not on the host yet), and whether it prefills.

        Its decode rows are the in-flight sequences that end their prompt or decode in that step and will
        not finish by length when its tokens arrive (one that stops on EOS is found out later and its
        extra row discarded); each gets room for one position more than it holds. In a mixed step model
        the step also admits prefill chunks of waiting requests in what is left of the budget (their
        tokens are on the host already). Empty (run the steps one by one) when the lookahead cannot
        take the step: running sequences outside the batch, too few free blocks, a prompt still
        being chunked in flight, or (nano-vllm's step model) requests waiting: then, with prefill_ahead, the
        step is their prefill (its rows need nothing of the step in flight). With decode_behind_prefill, a prefill
        in flight (inflight_prefill) may have the decode after it launched behind it (_behind_prefill); with
        prefill_behind_prefill, the prefill of requests waiting behind it, where its prompts all end in it.
        """
        if inflight_prefill and not self.mixed:
            if self.prefill_behind_prefill and self.waiting and set(inflight) <= set(self.running):
                seqs, is_prefill = self._prefill_behind()   # (a prompt chunked in flight is waiting, not running)
                if seqs:
                    return seqs, is_prefill
            return self._behind_prefill(inflight) if self.decode_behind_prefill else ([], False)
        # the running requests are the in-flight step's (a prompt still being chunked in flight is waiting,
        # not running, and an aborted one is in neither: both break the equality)
        if set(self.running) != set(inflight):
            return [], False
        if self.waiting and not self.mixed:
            return self._prefill_behind()
        nxt = [s for s in inflight if not s.is_finished and not self._length_reached(s, ahead=1)]
        bm = self.block_manager
        if len(nxt) > self.max_num_batched_tokens or \
                sum(bm.blocks_needed_to_append(s, ahead=1) for s in nxt) > bm.num_free_blocks:
            return [], False
        for s in nxt:
            bm.may_append(s, ahead=1)
            s.decoding = True
        prefills: list[Sequence] = []
        if self.waiting:
            prefills = self._schedule_prefill(budget=self.max_num_batched_tokens - len(nxt),
                                              seats=self.max_num_seqs - len(nxt), chunk_any=True)
        return nxt + prefills, bool(prefills)

    def _prefill_behind(self) -> tuple[list[Sequence], bool]:
        """nano-vllm's step model, requests waiting behind a decode in flight: their prefill as the next step
        (schedule()'s prefill rule, the policy's cap on prefill steps in a row too), or none without
        prefill_ahead."""
        if not self.prefill_ahead or self._prefill_capped():
            return [], False
        seqs = self._schedule_prefill()
        if seqs:
            self._prefill_run += 1
        return seqs, bool(seqs)

    def _behind_prefill(self, inflight: list[Sequence]) -> tuple[list[Sequence], bool]:
        """nano-vllm's step model, a prefill in flight whose prompts all end in it, and schedule() would
        decode next (nothing waiting, or the policy's cap on prefills in a row reached): that decode of every
        running request, launched before the prefill's tokens are read. The in-flight prefill's rows come
        first, one position ahead (their first token is fed on the device), then the others, whose last
        token is on the host. Empty (one by one) where requests wait (their prefill waits for the one in
        flight to register its blocks in the prefix cache), that decode would need a preemption or pass
        max_num_seqs, or a prompt in flight is still being chunked or was aborted."""
        in_flight = set(inflight)
        if not in_flight <= set(self.running) or (self.waiting and not self._prefill_capped()):
            return [], False
        fed = [s for s in inflight if not self._length_reached(s, ahead=1)]
        rest = [s for s in self.running if s not in in_flight]
        bm = self.block_manager
        if len(fed) + len(rest) > self.max_num_seqs or sum(bm.blocks_needed_to_append(s, ahead=1) for s in fed) + \
                sum(bm.blocks_needed_to_append(s) for s in rest) > bm.num_free_blocks:
            return [], False
        for s in fed:
            bm.may_append(s, ahead=1)
            s.decoding = True
        for s in rest:
            bm.may_append(s)
            s.num_scheduled_tokens = 1
            s.decoding = True
        self._prefill_run = 0
        return fed + rest, False

    def _prefill_capped(self) -> bool:
        """The policy's cap on prefill steps in a row is reached: decode gets the next turn."""
        cap = self.max_consecutive_prefill
        return cap is not None and self._prefill_run >= cap

    def _length_reached(self, seq: Sequence, ahead: int = 0) -> bool:
        """Whether seq is at its length limit (max_tokens or max_model_len) with `ahead` more tokens."""
        return (seq.num_completion_tokens + ahead >= seq.sampling_params.max_tokens
                or seq.num_tokens + ahead >= self.max_model_len)

    def preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        seq.num_scheduled_tokens = 0
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    # -- after the forward -----------------------------------------------------
    def postprocess(self, seqs: list[Sequence], token_ids: list[int], is_prefill: bool) -> StepOutcome:
        out = StepOutcome()
        for seq, token_id in zip(seqs, token_ids):
            completes = seq.step_reaches_end
            seq.num_cached_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0
            self.block_manager.hash_blocks(seq)
            if not completes:
                out.discarded.append(seq.seq_id)   # an intermediate chunk's candidate is not an output
                continue
            done = seq.grammar is not None and seq.grammar.accept(int(token_id))
            if done and seq.grammar.rejected:     # the mask left no token (min_tokens, allowed_token_ids): the
                out.freed_blocks += self.finish(seq, "abort")      # draw is no output; the request ends here
                out.finished.append(seq)
                continue
            seq.append_token(int(token_id))
            out.accepted[seq.seq_id] = int(token_id)
            reason = self._finish_reason(seq, int(token_id))
            if done and reason is None:
                reason = seq.grammar.end_reason     # complete (stop), or its mask work past its budget (abort)
            if reason:
                out.freed_blocks += self.finish(seq, reason)
                out.finished.append(seq)
        return out

    def _finish_reason(self, seq: Sequence, token_id: int) -> str | None:
        sp = seq.sampling_params
        if not sp.ignore_eos and token_id in self.eos:
            return "stop"
        if token_id in sp.stop_token_ids:
            return "stop"
        if self._length_reached(seq):
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> list[int]:
        """Mark seq finished, take it out of the queues and free its blocks at once."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        for queue in (self.running, self.waiting):
            if seq in queue:
                queue.remove(seq)
        return self.block_manager.deallocate(seq)
