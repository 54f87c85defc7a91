"""LLMEngine: add_request -> step (schedule -> run -> postprocess) -> outputs.

The request's path: ``add_request`` (engine/admission.py: encode, check) queues a Sequence; ``step`` =
``_schedule_step`` (engine/scheduler.py) -> ``ModelRunner.run`` (engine/model_runner.py: inputs, forward,
sampler) -> ``postprocess`` (the scheduler accepts the tokens, finishes sequences) -> a StepOutput. With
``overlap`` the steps go through ``_step_overlapped`` (engine/overlap.py): ``ModelRunner.launch`` of step k+1
before step k's tokens are read."""
from __future__ import annotations

import dataclasses
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from engine import admission
from engine.block_manager import BlockManager
from engine.args import EngineArgs
from engine.config import Config
from engine.errors import RequestError
from engine.graph import Route
from engine.levers import admit_in_flight, prefill_ahead
from engine.model_runner import ModelRunner
from engine.observe import EngineEvent, EventBus, HookSet, StepHooks
from engine.overlap import InFlight, OverlappedSteps
from engine.probe import EngineProbe
from engine.sampling import feasible
from engine.sampling.params import SamplingParams
from engine.sampling.structured import Grammars
from engine.scheduler import Scheduler, StepOutcome
from engine.sequence import Sequence, SequenceCounter
from engine.step_inputs import StepInputs
from engine.step_output import StepOutput, step_kind

__all__ = ["LLMEngine", "EngineStats", "StepOutput", "RequestError", "step_kind"]


@dataclass(frozen=True)
class EngineStats:
    """Queue and KV pool numbers, read between steps."""
    waiting: int
    running: int
    num_blocks: int
    free_blocks: int
    used_blocks: int
    step: int
    preemptions: int = 0          # sequences preempted so far (vLLM's num_preemptions)
    prefix_queries: int = 0       # prompt tokens looked up in the prefix cache at admission (vLLM's)
    prefix_hits: int = 0          # of them, tokens found cached
    late_compiles: int = 0        # Triton kernels compiled after start-up (engine/warmup.py: CompileWatch)

    def totals(self) -> dict[str, int]:
        """The running totals under the names the service's snapshot and metrics use."""
        return {"engine_preemptions": self.preemptions, "prefix_cache_queries": self.prefix_queries,
                "prefix_cache_hits": self.prefix_hits, "triton_compiles_after_startup": self.late_compiles}


class LLMEngine(OverlappedSteps):
    def __init__(self, args: EngineArgs | str, **options):
        """``LLMEngine(args)`` with an :class:`EngineArgs`; ``LLMEngine(model, **options)`` is the shorthand
        (nano-vllm's ``LLM(model, **kw)``) for ``LLMEngine(EngineArgs(model, **options))``."""
        init_start = time.perf_counter()
        self.config = Config(args, **options)
        self.config.check_machine()
        if self.config.tensor_parallel_size > 1:
            from engine.tp_workers import start_rank0
            device = self.config.resolved_device()
            tp, workers = start_rank0(self.config, device)
            try:
                self.runner = ModelRunner(self.config, tp=tp, workers=workers,
                                          device="cuda:0" if device.startswith("cuda") else device)
            except BaseException:
                workers.close()
                raise
        else:
            self.runner = ModelRunner(self.config)
        self.hooks = HookSet()
        self.runner.hooks = self.hooks
        self._fresh_scheduling()
        self.events = EventBus()
        self.runner.on_inputs = self._emit_inputs
        self._next_id = SequenceCounter()
        self.num_steps = 0
        self._tokenizer = None
        self._closed = False
        self._inflight: InFlight | None = None
        # LAB_ADMIT_IN_FLIGHT (engine/levers.py, on by default): the host's hook that admits the requests that
        # arrived since the last step() call, True when it admitted any (a serving worker sets it; None: nothing to
        # ask)
        self.arrivals: Callable[[], bool] | None = None
        self.admit_in_flight = admit_in_flight(self.config)
        # structured outputs: one grammar compiler and cache, built on the first constrained request
        self.grammars = Grammars(lambda: self.tokenizer, self.config.vocab_size, tuple(self.config.eos_token_ids))
        self.probe = EngineProbe(self)      # the lab's read-only views (block ref counts, the pool, modules)
        self.init_seconds = time.perf_counter() - init_start

    # -- identity ------------------------------------------------------------------
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(self.config.model)
        return self._tokenizer

    def describe(self) -> dict:
        return {
            "config": self.config.summary(),
            "device": self.runner.device,
            "tensor_parallel": {"size": self.config.tensor_parallel_size,
                                "dist_init": self.runner.workers.dist_init if self.runner.workers else None,
                                "shm_name": self.runner.workers.shm_name if self.runner.workers else None},
            "dtype": str(self.runner.dtype).replace("torch.", ""),
            "attention_backend": self.runner.attention_backend,
            "fused_ops": self.runner.fused_ops,
            "gemv_rows": self.runner.gemv_rows,              # tokens a projection takes through the GEMV (LAB_GEMV_ROWS)
            "skinny_rows": self.runner.skinny_rows,          # ... through the split-K GEMM from 2 (LAB_SKINNY_GEMM)
            "fp8_decode": self.runner.fp8_decode,            # the e4m3 decode's knobs from LAB_FP8_DECODE ({}: defaults)
            "decode_knobs": self.runner.decode_knobs,        # the bf16 / float32 decode's from LAB_DECODE ({}: defaults)
            "model": self.runner.model.describe() if self.runner.model is not None else None,   # family, q/k route
            "pdl": self.runner.pdl,
            "prefill_ahead": self.scheduler.prefill_ahead,   # a waiting prefill launched behind a decode in flight
            "decode_behind_prefill": self.scheduler.decode_behind_prefill,   # and the decode after it behind it
            "prefill_behind_prefill": self.scheduler.prefill_behind_prefill,   # a waiting prefill behind a prefill
            "admit_in_flight": self.admit_in_flight,         # LAB_ADMIT_IN_FLIGHT: arrivals admitted behind a prefill
            "num_kvcache_blocks": self.runner.num_kvcache_blocks,
            "kv_cache": self._kv_cache_info(),
            "memory": self.runner.memory,
            "graph": {"enabled": self.runner.graphs is not None,
                      "buckets": self.runner.graphs.buckets if self.runner.graphs else [],
                      "prefill_buckets": self.runner.prefill_graphs.buckets if self.runner.prefill_graphs else [],
                      "prefill_seqs": self.runner.prefill_graphs.max_seqs if self.runner.prefill_graphs else 0,
                      "paged_prefill": self.runner.paged_prefill_graphs is not None,
                      "mixed_buckets": [list(k) for k in self.runner.mixed_graphs.buckets] if self.runner.mixed_graphs
                      else [],
                      "piecewise_buckets": self.runner.piecewise.buckets if self.runner.piecewise else [],
                      "piecewise_seqs": self.runner.piecewise.max_seqs if self.runner.piecewise else 0,
                      "capture_seconds": round(self.runner.capture_seconds, 4)},
            "warmup": {"seconds": round(self.runner.warm_seconds, 4), "shapes": len(self.runner.warmed),
                       "paths": dict(Counter(w["path"] for w in self.runner.warmed))},
            "load_seconds": round(self.runner.load_seconds, 4),
            "init_seconds": round(self.init_seconds, 4),
        }

    def _kv_cache_info(self) -> dict:
        """The KV pool's dtype as asked (kv_cache_dtype) and as held, and an FP8 pool's K and V scales
        (engine/attention/kv_quant.py; None for a pool in the model's dtype)."""
        from engine.attention import kv_quant

        layer = next(iter(self.runner.model.attention_layers()), None) if self.runner.model is not None else None
        k, v = (layer.k_cache, layer.v_cache) if layer is not None else (torch.empty(0), torch.empty(0))
        scales = {"k": kv_quant.scale_of(k), "v": kv_quant.scale_of(v)} if kv_quant.is_fp8(k) else None
        return {"kv_cache_dtype": self.config.kv_cache_dtype, "dtype": str(k.dtype).replace("torch.", ""),
                "v_transposed": kv_quant.v_transposed(v),          # LAB_FP8_V_T's layout
                "bytes_per_token": self.config.shape.kv_bytes_per_token(k.element_size(),
                                                                         self.config.tensor_parallel_size),
                "scales": scales}

    def add_hooks(self, hooks: StepHooks) -> Callable[[], None]:
        """Register step hooks (see engine/observe.py); returns the function that removes them."""
        return self.hooks.add(hooks)

    @contextmanager
    def eager_decode(self) -> Iterator[None]:
        """Inside the block every step runs eagerly: the captured decode graphs are set aside (kept, not
        freed) and come back after, e.g. so that a profiler's module ranges see each decode kernel."""
        graphs, self.runner.graphs = self.runner.graphs, None
        try:
            yield
        finally:
            self.runner.graphs = graphs

    # -- reading and driving the engine from outside ------------------------------------
    def stats(self) -> EngineStats:
        bm, sch = self.block_manager, self.scheduler
        watch = self.runner.late_compiles
        return EngineStats(len(sch.waiting), len(sch.running), bm.num_blocks, bm.num_free_blocks,
                           len(bm.used_block_ids), self.num_steps, sch.num_preemptions, sch.prefix_queries,
                           sch.prefix_hits, len(watch.names) if watch is not None else 0)

    def live_seq_ids(self) -> set[int]:
        return {s.seq_id for s in (*self.scheduler.waiting, *self.scheduler.running)}

    def check_invariants(self) -> tuple[bool, str]:
        """Between steps: every used KV block belongs to a live sequence, free + used = pool, and no
        sequence still holds scheduled tokens. Returns (ok, why)."""
        sch, bm = self.scheduler, self.block_manager
        live = [*sch.waiting, *sch.running]
        held = {b for s in live for b in s.block_table}
        if held != bm.used_block_ids:
            return False, f"{len(bm.used_block_ids - held)} used KV blocks belong to no live sequence"
        if bm.num_free_blocks + len(bm.used_block_ids) != bm.num_blocks:
            return False, "free + used KV blocks != pool size"
        stale = [s.seq_id for s in live if s.num_scheduled_tokens]
        if stale:
            return False, f"seqs {stale} still have scheduled tokens"
        return True, "consistent"

    def reset_scheduling(self) -> None:
        """A fresh scheduler and block manager on the same model and KV pool: no queue, no prefix
        cache, every block free (between runs, with nothing in flight)."""
        if not self.is_finished():
            raise RuntimeError("reset_scheduling needs an idle engine (requests are in flight)")
        self._fresh_scheduling()

    def _fresh_scheduling(self) -> None:
        self.block_manager = BlockManager(self.runner.num_kvcache_blocks, self.config.kvcache_block_size,
                                          shuffle_blocks=self.config.shuffle_blocks,
                                          enable_prefix_caching=self.config.enable_prefix_caching)
        self.scheduler = Scheduler(self.config.scheduler_limits(), self.block_manager)
        s = self.scheduler
        s.prefill_ahead, s.decode_behind_prefill, s.prefill_behind_prefill = prefill_ahead(self.config)

    def forward_logits(self, seqs: list[Sequence], is_prefill: bool) -> tuple[torch.Tensor, Route]:
        """The logits of a scheduled batch (from schedule()) without sampling, and the route they took;
        hand the chosen ids to postprocess() to finish the step (teacher forcing)."""
        logits, route, _ = self.runner.forward(seqs, is_prefill, step=self.num_steps)
        return logits, route

    # -- requests ------------------------------------------------------------------
    def encode(self, prompt, **options) -> list[int]:
        """Text as is, chat messages through the chat template, or token ids (engine/admission.py; options:
        add_generation_prompt, continue_final_message, add_special_tokens). Token ids need no tokenizer: a model
        directory without one runs on ids."""
        if isinstance(prompt, (list, tuple)) and not (prompt and isinstance(prompt[0], dict)):
            return list(prompt)
        return admission.encode(self.tokenizer, prompt, **options)

    def validate(self, token_ids: list[int], sampling_params: SamplingParams | None = None) -> None:
        """The one admission rule, offline and online (engine/admission.py: check_request) over this
        engine's config and KV pool."""
        admission.check_request(self.config, self.block_manager.num_blocks, token_ids, sampling_params)
        if sampling_params is not None and sampling_params.structured_outputs is not None:
            self.grammars.compile(sampling_params.structured_outputs)     # compiled here, pinned for add_request
            feasible.check(self.grammars, sampling_params)                # a grammar that leaves no token

    #: validate()'s rule over an engine's config and KV pool size alone, and encode()'s over a given
    #: tokenizer, for a front end in another process that checks and encodes requests itself with the
    #: limits its engine reported (labkit serve --engine-process)
    check_request = staticmethod(admission.check_request)
    encode_with = staticmethod(admission.encode)

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, *,
                    validated: bool = False, prefill_after: Sequence | None = None) -> Sequence:
        """Queue a request. validated=True: token ids already passed validate() with these params.
        prefill_after: a sibling with the same prompt (n > 1) whose prefill this one waits for, so that
        it reuses the prompt's full KV blocks through the prefix cache instead of computing them again."""
        sampling_params = sampling_params or SamplingParams()
        token_ids = list(prompt) if validated else self.encode(prompt)
        if not validated:
            self.validate(token_ids, sampling_params)
        seq = Sequence(self._next_id(), token_ids, sampling_params, self.config.kvcache_block_size)
        seq.prefill_after = prefill_after
        if sampling_params.structured_outputs is not None:     # its own matcher (over the grammar validate pinned)
            seq.grammar = self.grammars.matcher(sampling_params.structured_outputs)
        self.scheduler.add(seq)
        return seq

    def add_samples(self, token_ids: list[int], sampling_params: SamplingParams) -> list[Sequence]:
        """n = sampling_params.n sequences of one (validated) prompt: the first prefills it, the others
        wait for that and share its full KV blocks; with a seed, sample i uses seed + i. Prompt log-probs
        (the same for every sample) are computed by the first only."""
        seqs: list[Sequence] = []
        for i in range(sampling_params.n):
            sp = dataclasses.replace(sampling_params, n=1, best_of=None,
                                     seed=None if sampling_params.seed is None else sampling_params.seed + i,
                                     prompt_logprobs=sampling_params.prompt_logprobs if i == 0 else None)
            seqs.append(self.add_request(token_ids, sp, validated=True, prefill_after=seqs[0] if seqs else None))
        return seqs

    def reset_prefix_cache(self) -> int:
        """Start the next requests with a cold prefix cache (between runs, with nothing in flight)."""
        if not self.is_finished():
            raise RuntimeError("reset_prefix_cache needs an idle engine (requests are in flight)")
        return self.block_manager.reset_prefix_cache()

    def abort(self, seq: Sequence, reason: str = "cancelled") -> list[int]:
        """Stop a request now and free its KV blocks (call between steps)."""
        if seq.is_finished:
            return []
        self.runner.sampler.forget(seq.seq_id)
        return self.scheduler.finish(seq, reason)

    # -- the loop --------------------------------------------------------------------
    def _emit_inputs(self, inputs: StepInputs) -> None:
        if self.events:
            data = {"input_shape": list(inputs.input_ids.shape), "input_ids": inputs.input_ids.tolist(),
                    "positions": inputs.positions.tolist(), **inputs.meta.summary()}
            self.events.emit(EngineEvent("inputs", self.num_steps, "prefill" if inputs.is_prefill else "decode", data))

    def schedule(self) -> tuple[list[Sequence], bool]:
        """The next batch, counted and announced as a step (hooks, events), for callers that drive the
        step themselves: forward_logits() or their own ids, then postprocess()."""
        seqs, is_prefill, _ = self._schedule_step()
        return seqs, is_prefill

    def _schedule_step(self, after: list[Sequence] | None = None,
                       after_prefill: bool = False) -> tuple[list[Sequence], bool, list[tuple[int, int]]]:
        """The next batch from the scheduler (after: the batch still in flight, a prefill with after_prefill,
        whose next step is scheduled ahead: Scheduler.schedule_lookahead), counted as a step and announced to
        the hooks and the events. Returns it with its (seq_id, positions computed) list, built once: the hooks,
        the events and the StepOutput all take this one."""
        with self.hooks.phase("schedule", self.num_steps + 1):
            if after is None:
                seqs, is_prefill = self.scheduler.schedule()
            else:
                seqs, is_prefill = self.scheduler.schedule_lookahead(after, after_prefill)
        if not seqs:
            return seqs, is_prefill, []
        self.num_steps += 1
        # a decode row computes one position (a lookahead's row still holds its in-flight step's count)
        batch = [(s.seq_id, 1 if s.decoding else s.num_scheduled_tokens) for s in seqs]
        if self.hooks:
            self.hooks.scheduled(self.num_steps, is_prefill, batch)
        if self.events:
            self.events.emit(EngineEvent("scheduled", self.num_steps, step_kind(seqs, is_prefill),
                                         {"seqs": [s.snapshot() for s in seqs]}))
        return seqs, is_prefill, batch

    def postprocess(self, seqs: list[Sequence], token_ids: list[int], is_prefill: bool,
                    step: int | None = None) -> StepOutcome:
        with self.hooks.phase("postprocess", self.num_steps if step is None else step):
            outcome = self.scheduler.postprocess(seqs, token_ids, is_prefill)
            for seq in outcome.finished:
                self.runner.sampler.forget(seq.seq_id)
        if self.events:
            self.events.emit(EngineEvent("postprocessed", self.num_steps, "prefill" if is_prefill else "decode", {
                "accepted": {str(k): v for k, v in outcome.accepted.items()},
                "discarded": outcome.discarded,
                "finished": [s.seq_id for s in outcome.finished],
                "freed_blocks": outcome.freed_blocks,
                "seqs": [s.snapshot() for s in seqs],
                "running": [s.seq_id for s in self.scheduler.running],
                "waiting": [s.seq_id for s in self.scheduler.waiting],
                "free_blocks": self.block_manager.num_free_blocks,
                "pool": self.probe.pool(),
            }))
        return outcome

    def step(self) -> StepOutput:
        if self.config.overlap:
            return self._step_overlapped()
        t0 = time.perf_counter()
        seqs, is_prefill, batch = self._schedule_step()
        if not seqs:
            return StepOutput(self.num_steps, is_prefill, [], StepOutcome(), 0)
        kind = step_kind(seqs, is_prefill)
        token_ids, route, row_logprobs, wait_s, span = self.runner.run(seqs, is_prefill, self.num_steps)
        outcome = self.postprocess(seqs, token_ids, is_prefill)
        return StepOutput(self.num_steps, is_prefill, seqs, outcome, sum(n for _, n in batch),
                          time.perf_counter() - t0, batch, route, self._keep_logprobs(seqs, row_logprobs, outcome),
                          wait_s, span, kind)

    @staticmethod
    def _keep_logprobs(seqs: list[Sequence], row_logprobs: dict, outcome: StepOutcome) -> dict:
        """The accepted tokens' log-probs, appended to their sequences; seq_id -> TokenLogprob."""
        kept = {}
        for row, lp in row_logprobs.items():
            seq = seqs[row]
            if seq.seq_id in outcome.accepted:
                seq.output_logprobs.append(lp)
                kept[seq.seq_id] = lp
        return kept

    def is_finished(self) -> bool:
        return self.scheduler.is_finished() and self._inflight is None

    def generate(self, prompts: Iterable, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_progress: bool = False, on_step: Callable[[StepOutput], None] | None = None) -> list[dict]:
        """Run the prompts to the end; on_step sees every step's output (timing, phase, batch).
        A single text prompt may be passed as a plain string."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not isinstance(sampling_params, list):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        token_ids = [self.encode(p) for p in prompts]
        for ids, sp in zip(token_ids, sampling_params):     # refuse the batch before queueing any of it
            self.validate(ids, sp or SamplingParams())
        groups = [self.add_samples(ids, sp or SamplingParams()) for ids, sp in zip(token_ids, sampling_params)]
        seqs = [s for g in groups for s in g]
        progress = _progress(len(seqs)) if use_progress else None
        texts: dict[int, str] = {}
        try:
            while not self.is_finished():
                out = self.step()
                for seq in out.finished:       # detokenized as it finishes: overlapped, the GPU runs the next step
                    texts[seq.seq_id] = self.tokenizer.decode(seq.completion_token_ids)
                if on_step is not None:
                    on_step(out)
                if progress is not None and out.finished:
                    progress.advance(len(out.finished))
        finally:
            if progress is not None:
                progress.stop()
        output = lambda s: self.output(s, texts.get(s.seq_id))       # noqa: E731
        return [output(g[0]) if len(g) == 1 else {**output(g[0]), "outputs": [output(s) for s in g]} for g in groups]

    def output(self, seq: Sequence, text: str | None = None) -> dict:
        """One sequence's result (text: its completion already detokenized); with n > 1, generate() returns
        the first sample's fields plus "outputs" (every sample). "logprobs" / "prompt_logprobs" (lists of
        TokenLogprob) only when asked for."""
        ids = seq.completion_token_ids
        out = {"seq_id": seq.seq_id, "token_ids": ids, "text": self.tokenizer.decode(ids) if text is None else text,
               "finish_reason": seq.finish_reason, "num_prompt_tokens": seq.num_prompt_tokens}
        if seq.sampling_params.logprobs is not None:
            out["logprobs"] = list(seq.output_logprobs)
        if seq.prompt_logprobs is not None:
            out["prompt_logprobs"] = list(seq.prompt_logprobs)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.runner.close()


class _progress:
    """A rich progress bar over finished requests (rich is imported only when asked for)."""

    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
        self._p = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), transient=True)
        self._task = self._p.add_task("generate", total=total)
        self._p.start()

    def advance(self, n: int) -> None:
        self._p.advance(self._task, n)

    def stop(self) -> None:
        self._p.stop()
