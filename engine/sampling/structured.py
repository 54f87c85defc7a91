"""Structured outputs (vLLM's ``StructuredOutputsParams``) through xgrammar, the grammar engine vLLM and SGLang use.

A request's :class:`StructuredOutputsParams` names exactly one constraint: a JSON schema (``json``), any JSON
object (``json_object``), a regular expression (``regex``), one of a list of strings (``choice``), an EBNF
grammar in xgrammar's GBNF dialect (``grammar``), or an xgrammar structural tag (``structural_tag``).

Where each part runs:
- admission (``LLMEngine.validate`` / ``add_request``, never the step): :class:`Grammars` compiles the
  constraint once per (kind, text) with the engine's one ``xgrammar.GrammarCompiler`` (built on first use from
  the engine's tokenizer) and keeps it (a cache bounded by bytes), pinned on the request's params for the
  request's lifetime; a constraint xgrammar cannot compile is a ``RequestError`` (``invalid_structured_outputs``).
  Each sequence gets its own :class:`SequenceGrammar` (a GrammarMatcher) over its pinned grammar: the step loop
  never compiles, even when the cache dropped the grammar while the request waited.
- the sampler (engine/sampling/sampler.py): :class:`GrammarMask` fills the bitmask of the step's constrained
  rows and sets their disallowed logits to -inf before anything else reads them (both sampling paths, greedy
  included, and the log-probs: vLLM applies the bitmask before its sampler too).
- postprocess (engine/scheduler.py): the matcher takes each accepted token; a matcher that terminates finishes
  the request with ``stop``; one whose mask and accept took more than its per-step budget of CPU time
  (:class:`SequenceGrammar`) finishes it with ``abort`` (the worker's cause ``grammar_budget``). EOS is in the mask only where the grammar may end (the matcher's stop tokens are
  the engine's EOS ids).

``structural_tag`` takes what xgrammar 0.2.9 compiles: the current format ``{"type": "structural_tag",
"format": {...}}`` (e.g. ``triggered_tags`` / ``tag`` / ``json_schema`` formats) and the older vLLM shape
``{"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}``; either as a dict or a JSON string.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import threading
import time
from collections import OrderedDict
import queue
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, fields
from typing import Any, Callable

import torch

from engine.errors import RequestError
from engine.sampling import json_strings, string_bounds

#: xgrammar's C++ message prefixes: "[19:46:40] /project/cpp/file.cc:94: ", "Check failed: (...) is false: "
XGR_PREFIX = re.compile(r"^(\[[\d:]+\] )?(\S+\.cc:\d+: )?(Check failed: .*? is false: )?")
KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
CODE = "invalid_structured_outputs"


def _bad(name: str, message: str) -> RequestError:
    return RequestError(f"structured_outputs.{name} {message}", CODE)


def _json_value(name: str, value: Any) -> Any:
    """A dict as is; a string parsed as JSON (must give an object, or a boolean schema for json)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise _bad(name, f"is not valid JSON: {e}") from None
    if isinstance(value, dict) or (name == "json" and isinstance(value, bool)):
        return value
    raise _bad(name, f"must be a JSON object (a dict or its JSON text), got {type(value).__name__}")


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output; exactly one field set (json_object: True)."""
    json: dict | str | None = None                 # a JSON schema (dict or JSON text)
    json_object: bool | None = None                # any JSON object
    regex: str | None = None
    choice: list[str] | None = None                # the output is exactly one of these strings
    grammar: str | None = None                     # EBNF (xgrammar's GBNF dialect, root rule "root")
    structural_tag: dict | str | None = None       # xgrammar structural tag (see the module docstring)
    # JSON without free whitespace (vLLM's name): json / json_object compact; a structural tag's json_schema
    # parts at most one whitespace character between tokens (where the tag does not set max_whitespace_cnt)
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise RequestError("structured_outputs must set exactly one of " + ", ".join(KINDS)
                               + (f" (got {', '.join(given)})" if given else ""), CODE)
        if self.json_object not in (None, True, False):
            raise _bad("json_object", f"must be true or false, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise _bad("disable_any_whitespace", f"must be true or false, got {self.disable_any_whitespace!r}")
        kind = given[0]
        if kind in ("json", "structural_tag"):
            setattr(self, kind, _json_value(kind, getattr(self, kind)))
        elif kind in ("regex", "grammar"):
            v = getattr(self, kind)
            if not isinstance(v, str) or not v:
                raise _bad(kind, f"must be a non-empty string, got {v!r}"[:200])
        elif kind == "choice":
            v = self.choice
            if not isinstance(v, (list, tuple)) or not v or not all(isinstance(c, str) and c for c in v):
                raise _bad("choice", "must be a non-empty list of non-empty strings")
            self.choice = list(v)
        self._kind = kind

    @classmethod
    def of(cls, value: "StructuredOutputsParams | dict") -> "StructuredOutputsParams":
        """A dict with the fields' names (vLLM's JSON shape) as params; unknown names are refused."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise RequestError(f"structured_outputs must be an object, got {type(value).__name__}", CODE)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - names)
        if unknown:
            raise RequestError(f"structured_outputs has unknown field(s) {', '.join(unknown)}; "
                               f"expected one of {', '.join(KINDS)}", CODE)
        return cls(**value)

    @property
    def kind(self) -> str:
        return self._kind

    def __getstate__(self) -> dict:
        """Pickled (to an engine process) without the compiled grammar pinned here: that one belongs to this
        process's compiler (:meth:`Grammars.compile` pins it)."""
        state = dict(self.__dict__)
        state.pop("_pinned", None)
        return state

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): the compile cache's key."""
        v = getattr(self, self._kind)
        if self._kind in ("regex", "grammar"):
            text = v
        elif self._kind == "json_object":
            text = ""
        else:
            text = json.dumps(v, sort_keys=True, ensure_ascii=False)
        return (self._kind + (":compact" if self.disable_any_whitespace else ""), text)


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose language is exactly the given strings (JSON string escapes are GBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _legacy_structural_tag(compiler, tag: dict):
    """vLLM's older {"structures": [{"begin", "schema", "end"}], "triggers": [...]} through xgrammar's
    (deprecated) two-argument form."""
    import xgrammar as xgr

    tag, bounded = string_bounds.bound(tag)
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not isinstance(triggers, list) or set(tag) - {"structures", "triggers"}:
        raise ValueError("the older form is {structures: [{begin, schema, end}], triggers: [...]}")
    items = []
    for s in structures:
        if not isinstance(s, dict) or set(s) != {"begin", "schema", "end"}:
            raise ValueError("each structure needs exactly begin, schema and end")
        items.append(xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]))
    if bounded or json_strings.affected(json.dumps(structures)):
        ebnf = string_bounds.splice(str(xgr.Grammar.from_structural_tag(items, triggers)), bounded)
        return compiler.compile_grammar(json_strings.guard(ebnf))
    return compiler.compile_structural_tag(items, triggers)


def _compile(compiler, so: StructuredOutputsParams):
    kind = so.kind
    ws = dict(any_whitespace=not so.disable_any_whitespace)
    if kind == "json":
        schema, bounded = string_bounds.bound(so.json)      # a pattern's length bounds kept (string_bounds.py)
        text = json.dumps(schema)
        if bounded or json_strings.affected(text):  # length-bounded strings: control characters kept out
            import xgrammar as xgr
            ebnf = string_bounds.splice(str(xgr.Grammar.from_json_schema(text, **ws)), bounded)
            return compiler.compile_grammar(json_strings.guard(ebnf))
        return compiler.compile_json_schema(text, **ws)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', **ws)
    if kind == "regex":
        return compiler.compile_regex(so.regex)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(so.choice))
    if kind == "grammar":
        return compiler.compile_grammar(so.grammar)
    tag = so.structural_tag
    if "structures" in tag:
        return _legacy_structural_tag(compiler, tag)
    tag, bounded = string_bounds.bound(tag)
    if so.disable_any_whitespace:
        tag = _bounded_whitespace(tag)
    text = json.dumps(tag)
    if bounded or json_strings.affected(text):
        import xgrammar as xgr
        ebnf = string_bounds.splice(str(xgr.Grammar.from_structural_tag(text)), bounded)
        return compiler.compile_grammar(json_strings.guard(ebnf))
    return compiler.compile_structural_tag(text)


def _bounded_whitespace(node: Any) -> Any:
    """A structural tag whose json_schema parts allow at most one whitespace character between JSON tokens
    (xgrammar's max_whitespace_cnt; its structural tags have no compact switch), where the tag sets none."""
    if isinstance(node, list):
        return [_bounded_whitespace(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k == "json_schema" else _bounded_whitespace(v)) for k, v in node.items()}
    if node.get("type") == "json_schema" and "max_whitespace_cnt" not in node:
        out["max_whitespace_cnt"] = 1
    return out


class SequenceGrammar:
    """One sequence's matcher: fills its row of the step's bitmask, takes its accepted tokens, and counts the
    CPU time both take in each step (the thread's own time, so a busy machine does not count against it).
    A step past ``budget_s`` marks it ``over_budget``: some grammars (an ambiguous EBNF) cost more with every
    token, and the whole batch waits for each row's mask, so the engine ends such a request (``end_reason``)
    before it slows everyone else more."""

    __slots__ = ("matcher", "rejected", "budget_s", "step_s", "over_budget")

    def __init__(self, matcher, budget_s: float | None = None):
        self.matcher = matcher
        self.rejected = False
        self.budget_s = budget_s               # None: no budget
        self.step_s = 0.0                      # this step's mask work so far
        self.over_budget = False

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        t0 = time.thread_time()
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.step_s = 0.0                      # a step starts with its mask
        self._charge(time.thread_time() - t0)

    def accept(self, token_id: int) -> bool:
        """Advance by one accepted token; True when the grammar is done (terminated, or the token was not
        one it allows: ``rejected``, which the mask makes impossible unless the engine is broken), or its
        step's mask work went past its budget (``over_budget``)."""
        t0 = time.thread_time()
        try:
            if not self.matcher.accept_token(token_id):
                self.rejected = True
                return True
            return self.matcher.is_terminated() or self.over_budget
        finally:
            self._charge(time.thread_time() - t0)

    def _charge(self, seconds: float) -> None:
        self.step_s += seconds
        if self.budget_s is not None and self.step_s > self.budget_s:
            self.over_budget = True

    @property
    def end_reason(self) -> str:
        """How a done grammar ends its request: ``stop`` when complete, else ``abort``."""
        return "abort" if self.rejected or not self.matcher.is_terminated() else "stop"


class Grammars:
    """The engine's grammar compiler and compile cache (key: kind + text). Built on first use: an engine that
    never sees a constrained request never loads xgrammar. Thread-safe: the service compiles at submit while
    the step loop runs.

    The cache is bounded by the compiled grammars' size (xgrammar's ``memory_size_bytes``: the token masks it
    keeps per grammar state, tens of MB for a schema of a few hundred KB over a 150k vocabulary), not by their
    count: ``cache_bytes`` in all, the least recently used going first; a grammar larger than the whole budget
    is not kept.

    Compiles run in workers of their own (``WORKERS`` threads, one compile each: never a thread of the pool
    that prepares text requests), under a budget: a compile that has not finished ``compile_timeout_s``
    after it was asked for (queued behind others included), or whose grammar holds more than
    ``max_grammar_bytes``, is a ``RequestError`` naming the field. xgrammar cannot stop a compile: one past
    its budget runs on to its end in its worker, its result dropped (one not yet started is cancelled once
    nobody waits for it); the same constraint asked again is refused at once, without a second compile."""

    CACHE_BYTES = 512 << 20      # compiled grammars kept, in bytes (labkit serve --grammar-cache-mb)
    COMPILE_TIMEOUT_S = 10.0     # a compile's time budget (labkit serve --grammar-compile-timeout)
    MAX_GRAMMAR_BYTES = 128 << 20   # one compiled grammar's size budget (labkit serve --grammar-max-mb)
    WORKERS = 1                  # compiles at once, each on one thread (xgrammar's max_threads=1): a costly
                                 # compile takes one core at most, the step loop keeps another
    STEP_BUDGET_S = 0.010        # a request's mask work per step, CPU seconds (labkit serve --grammar-step-budget-ms)
    REFUSED = 1024               # constraints remembered as over budget (by digest)

    def __init__(self, tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_bytes: int | None = None, compile_timeout_s: float | None = None,
                 max_grammar_bytes: int | None = None, step_budget_s: float | None = None):
        self._tokenizer = tokenizer            # called once, on first use
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_bytes = self.CACHE_BYTES if cache_bytes is None else cache_bytes
        self.compile_timeout_s = self.COMPILE_TIMEOUT_S if compile_timeout_s is None else compile_timeout_s
        self.max_grammar_bytes = self.MAX_GRAMMAR_BYTES if max_grammar_bytes is None else max_grammar_bytes
        self.step_budget_s = self.STEP_BUDGET_S if step_budget_s is None else step_budget_s
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cached_bytes = 0
        self._inflight: dict[tuple[str, str], _Job] = {}
        self._refused: OrderedDict[bytes, str] = OrderedDict()
        self._pool: DaemonWorkers | None = None
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()

    @property
    def cached_bytes(self) -> int:
        """What the cached compiled grammars hold, in bytes."""
        return self._cached_bytes

    @property
    def compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer(), vocab_size=self.vocab_size,
                                                          stop_token_ids=self.eos_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, so: StructuredOutputsParams):
        """The compiled grammar of so (cached); RequestError naming the field when xgrammar refuses it or its
        compile is past its budget. Waits in the calling thread; :meth:`compile_async` waits on an event loop.

        The result is pinned on ``so`` (so on the request's params) for as long as the request lives: the
        cache may drop it meanwhile, the request's own matcher (:meth:`matcher`, made at admission, on the step
        loop) still finds it there and never compiles."""
        found, job = self._start(so)
        if job is not None:
            try:
                found = job.future.result(self.compile_timeout_s)
            except FutureTimeout:
                raise self._late(so, job) from None
        return self._pin(so, found)

    async def compile_async(self, so: StructuredOutputsParams):
        """:meth:`compile` awaited: the event loop waits for the compile worker, no thread blocks."""
        import asyncio

        found, job = self._start(so)
        if job is not None:
            waiting = asyncio.wrap_future(job.future)
            waiting.add_done_callback(lambda f: f.cancelled() or f.exception())    # read, even once left
            try:
                found = await asyncio.wait_for(asyncio.shield(waiting), self.compile_timeout_s)
            except asyncio.TimeoutError:
                raise self._late(so, job) from None
        return self._pin(so, found)

    def _start(self, so: StructuredOutputsParams):
        """(the compiled grammar, None) when pinned or cached, else (None, the compile job it waits for)."""
        pinned = so.__dict__.get("_pinned")
        if pinned is not None and pinned[0] is self:
            return pinned[1], None
        key = so.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit, None
            refused = self._refused.get(_digest(key))
            if refused is not None:
                raise _bad(so.kind, refused)
            job = self._inflight.get(key)
            if job is None:
                if self._pool is None:
                    self._pool = DaemonWorkers(self.WORKERS, "grammar-compile", nice=10)
                job = self._inflight[key] = _Job()
                job.future = self._pool.submit(self._run, so, key, job)
            job.waiters += 1
        return None, job

    def _run(self, so: StructuredOutputsParams, key: tuple[str, str], job: "_Job"):
        """A compile worker's job: compile, check the budgets, cache."""
        try:
            job.started = t0 = time.monotonic()
            try:
                compiled = _compile(self.compiler, so)
            except (RuntimeError, ValueError, TypeError) as e:
                msg = XGR_PREFIX.sub("", " ".join(str(e).split()))
                raise _bad(so.kind, f"cannot be compiled: {msg[:300]}") from None
            took, size = time.monotonic() - t0, _size(compiled)
            if took > self.compile_timeout_s:
                raise self._refuse(so, key, self._time_message())
            if size > self.max_grammar_bytes:
                raise self._refuse(so, key, f"compiles to a grammar of {size / 2**20:.0f} MiB, past the "
                                            f"{self.max_grammar_bytes / 2**20:.0f} MiB budget (--grammar-max-mb)")
            self._keep(key, compiled)
            with self._lock:
                self._refused.pop(_digest(key), None)
            return compiled
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def _late(self, so: StructuredOutputsParams, job: "_Job") -> RequestError:
        """A waiter's budget ran out: the refusal. A compile already running then is remembered as refused (it
        runs on: xgrammar cannot stop it; should it still end within the budget, it is cached and no longer
        refused); one nobody waits for any more that has not started (it was queued behind others) is
        cancelled."""
        with self._lock:
            job.waiters -= 1
            if job.waiters == 0 and job.future.cancel():
                self._inflight.pop(so.key(), None)
        if job.started is not None:
            return self._refuse(so, so.key(), self._time_message())
        return _bad(so.kind, self._time_message())

    def _time_message(self) -> str:
        return (f"was not compiled within the grammar compiler's {self.compile_timeout_s:g} s budget "
                f"(--grammar-compile-timeout)")

    def _refuse(self, so: StructuredOutputsParams, key: tuple[str, str], message: str) -> RequestError:
        """Remember key as over budget (asked again: refused at once) and give the refusal."""
        with self._lock:
            self._refused[_digest(key)] = message
            while len(self._refused) > self.REFUSED:
                self._refused.popitem(last=False)
        return _bad(so.kind, message)

    def _pin(self, so: StructuredOutputsParams, compiled):
        so._pinned = (self, compiled)
        return compiled

    def _keep(self, key: tuple[str, str], compiled) -> None:
        """Cache compiled under key, then drop the least recently used until the cache fits its byte budget."""
        size = _size(compiled)
        with self._lock:
            if key in self._cache or size > self.cache_bytes:
                return
            self._cache[key] = compiled
            self._cached_bytes += size
            while self._cached_bytes > self.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self._cached_bytes -= _size(old)

    def matcher(self, so: StructuredOutputsParams) -> SequenceGrammar:
        import xgrammar as xgr
        return SequenceGrammar(xgr.GrammarMatcher(self.compile(so), override_stop_tokens=self.eos_token_ids or None),
                               self.step_budget_s)


class DaemonWorkers:
    """Daemon threads that run submitted calls in order (``submit`` gives a concurrent Future, so an event loop's
    ``run_in_executor`` takes them): a call that runs on past its budget, or a thread idle on its queue, never
    holds the process at exit (a ThreadPoolExecutor's threads are joined then). ``nice`` (Linux, per thread
    there): a lower CPU priority, so that where cores are few a long grammar compile yields to the step loop and
    the event loop instead of sharing a core with them evenly."""

    def __init__(self, n: int, name: str, nice: int = 0):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._nice = nice
        for i in range(n):
            threading.Thread(target=self._loop, name=f"{name}-{i}", daemon=True).start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def _loop(self) -> None:
        if self._nice and sys.platform.startswith("linux"):
            try:
                tid = threading.get_native_id()                   # Linux: the priority is this thread's only
                os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + self._nice)
            except OSError:
                pass
        while True:
            future, fn, args = self._queue.get()
            if not future.set_running_or_notify_cancel():      # cancelled while queued
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:                         # the waiter gets it (a RequestError, mostly)
                future.set_exception(e)


class _Job:
    """One compile in a worker: its future, how many requests wait for it, when it started (None: queued)."""
    __slots__ = ("future", "waiters", "started")

    def __init__(self):
        self.future: Future | None = None
        self.waiters = 0
        self.started: float | None = None


def _digest(key: tuple[str, str]) -> bytes:
    return hashlib.sha256("\0".join(key).encode("utf-8", "surrogatepass")).digest()


def _size(compiled) -> int:
    """A compiled grammar's memory in bytes (xgrammar's own count)."""
    return int(compiled.memory_size_bytes)


class GrammarMask:
    """The step's token bitmask: filled on the host for the constrained rows, copied to the logits' device,
    applied in place (masked tokens -> -inf). One host buffer, grown to the widest batch seen."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._host: torch.Tensor | None = None
        self._copied = None                     # CUDA: the event after the last copy out of the host buffer

    def _buffer(self, rows: int, pin: bool) -> torch.Tensor:
        if self._host is None or self._host.shape[0] < rows:
            import xgrammar as xgr
            shape = xgr.get_bitmask_shape(max(rows, 8), self.vocab_size)
            self._host = torch.empty(shape, dtype=torch.int32, pin_memory=pin)
        return self._host

    def apply(self, logits: torch.Tensor, rows: list[tuple[int, SequenceGrammar]]) -> None:
        import xgrammar as xgr
        n = logits.shape[0]
        if self._copied is not None:
            self._copied.synchronize()          # the previous step's copy has left the buffer
        host = self._buffer(n, logits.is_cuda)
        for i, g in rows:
            g.fill(host, i)
        mask = host[:n]
        if logits.is_cuda:
            mask = mask.to(logits.device, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()
        xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=min(self.vocab_size, logits.shape[1]),
                                        indices=[i for i, _ in rows])
