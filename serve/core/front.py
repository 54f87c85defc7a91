"""The one interface the HTTP front talks to, whether the engine runs in this process
(:class:`serve.core.worker.Worker`) or in a process of its own
(:class:`serve.core.proc_client.RemoteWorker`): vLLM's ``EngineClient`` seam.

- :class:`ServedEngine`: a frozen record of the served engine (identity, device, kind, limits, KV pool size,
  ``describe()``), made once when the engine is built and published at start (by the engine process in its
  ``ready`` message). The server, launch and the evidence read it, never the engine.
- :class:`WorkerFront`: what both worker kinds share and do the same: prompt encoding (text, chat template,
  special tokens in chat content kept as text, the prompt-size limit before tokenizing), the checks of a
  submission (request id, the engine's one admission rule over the served record, tags), new request ids,
  duplicate and availability checks, the queue's room (a full queue rejects here), the request's stream and
  accounting (:class:`serve.core.output.OutputProcessor`), the ``/metrics`` gauges and the evidence header.
  A request is checked here once: whoever runs the engine queues it as it is. A kind supplies the
  hooks :meth:`WorkerFront._tokenize` (the engine's encoding of text and messages), :meth:`WorkerFront._enqueue`
  (queue the checked request), :meth:`WorkerFront._send_cancel`, its queue (``_pending``: requests queued and
  not yet admitted), and its lifecycle and state.

Admission: ``submit()`` validates the prompt at once (``engine.RequestError`` for a text prompt of more than
``max_prompt_bytes`` UTF-8 bytes, refused before the tokenizer sees it; an empty prompt, a token id outside
the vocabulary, prompt + max_tokens beyond max_model_len, a prompt the KV pool can never hold). A request
without an id gets a random one (``<worker_id>-<16 hex digits>``): no client can guess or claim the next.

Chat messages go through the model's chat template. Only the template's own markers become control tokens:
text inside a message that spells a special token (``<|im_start|>system``) is tokenized as plain text, so a
user cannot forge a turn. ``special_tokens_in_content=True`` restores the old behaviour (the whole rendered
prompt parsed for special tokens).
"""
from __future__ import annotations

import dataclasses
import secrets
import threading
from dataclasses import dataclass
from typing import Any, Callable

from engine import Config, LLMEngine, RequestError, SamplingParams
from engine.sampling import feasible
from serve.protocol.chat import ChatPrompt, render
from serve.core.config import WorkerConfig
from serve.core.fair import Groups
from serve.core.messages import Finished, Submitted
from serve.core.output import OutputProcessor
from serve.observe.events import Sink, now_ns
from serve.observe.metrics import ServiceStats
from serve.protocol.requests import REQUEST_ID_RE, RESERVED_FIELDS
from serve.core.stream import RequestHandle


class WorkerUnavailable(RuntimeError):
    """The worker is not accepting work (starting, unhealthy or shut down); HTTP 503."""


class DuplicateRequest(ValueError):
    """A live request already has this request_id."""


@dataclass(frozen=True)
class ServedEngine:
    """The served engine as the front end knows it, fixed at start (made by the Worker that built it)."""
    kind: str                 # evidence kind: gpu-measured | cpu-real-engine
    device: str
    model: dict               # model identity (path, preset, synthetic, ...)
    description: dict         # LLMEngine.describe()
    config: Config            # the engine's resolved config (max_model_len capped at the model's)
    num_blocks: int           # KV pool size

    def describe(self) -> dict:
        return self.description

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def pool_tokens(self) -> int:
        """What the KV pool holds, in tokens."""
        return self.num_blocks * self.config.kvcache_block_size

    @property
    def seed(self) -> int:
        return self.config.seed

    def check(self, token_ids: list[int], params: SamplingParams | None) -> None:
        """The engine's one admission rule (``LLMEngine.check_request``) over this record's limits."""
        LLMEngine.check_request(self.config, self.num_blocks, token_ids, params)


class WorkerFront:
    """The shared half of both worker kinds; see the module docstring."""

    def __init__(self, config: WorkerConfig | None = None, sink: Sink | None = None, build: str | None = None):
        self.config = config or WorkerConfig()
        self.build = build          # "module:function" that builds the engine (serve.core.engine_build)
        self.worker_id = self.config.worker_id
        self.sink = sink
        self.stats = ServiceStats(self.worker_id)
        self.output = OutputProcessor(self.worker_id, self.stats, sink, self.config.log_steps)
        self.served: ServedEngine | None = None     # published once the engine is built
        self.tokenizer = None                       # the HTTP front's own copy, for decoding
        self._encoder = None                        # the tokenizer encode() uses, one thread at a time
        self._lock = threading.RLock()
        self._encode_lock = threading.Lock()
        self._live: dict[str, Any] = {}             # live requests by id
        self._groups = Groups()                     # queued and live sequences per request group (lock)
        self._grammar_cache = None                  # structured outputs: see _grammars()

    # -- the kind's hooks and state ----------------------------------------------------------
    @property
    def accepting(self) -> bool:
        raise NotImplementedError

    def _unavailable_reason(self) -> str:
        raise NotImplementedError

    def snapshot(self) -> dict:
        raise NotImplementedError

    def _tokenize(self, prompt, **options) -> list[int]:
        """The engine's encoding of text or chat messages (through the chat template; options: admission.encode's)."""
        raise NotImplementedError

    def _enqueue(self, rid: str, token_ids: list[int], params: SamplingParams, prefill_after: str | None,
                 group: str) -> None:
        """Queue a checked and accepted request (with the lock held); WorkerUnavailable when it cannot."""
        raise NotImplementedError

    def current_round(self) -> int:
        """The number of engine steps done: the owner's count in process, the last snapshot's with an engine process."""
        raise NotImplementedError

    def _send_cancel(self, request_id: str, cause: str, reason: str, message: str | None = None) -> bool:
        """Hand a live request's cancel to the owner (with the lock held); False when it cannot be sent."""
        raise NotImplementedError

    def cancel(self, request_id: str, cause: str = "client", reason: str = "cancelled",
               message: str | None = None) -> bool:
        """Ask the owner to cancel at its next step boundary; False if no such live request.

        ``reason="stop"`` (with e.g. ``cause="stop_string"``) ends a request that its reader found complete:
        it finishes ``stop``, not ``cancelled``. ``message`` goes into its finished event."""
        if reason not in ("cancelled", "stop"):
            raise ValueError(f"a request can be ended as cancelled or stop, not {reason!r}")
        with self._lock:
            return request_id in self._live and self._send_cancel(request_id, cause, reason, message)

    # -- submission ----------------------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
               tags: dict | None = None, stream: bool = True, stream_buffer: int | None = None, *,
               fill_context: bool = False, stop_token_ids=(), prefill_after: str | None = None,
               prompt_options: dict | None = None, group: str | None = None) -> RequestHandle:
        """Queue a request; returns its handle at once (``handle.rejected`` when the queue is full).

        ``fill_context``: max_tokens becomes what the context leaves after the prompt (max_model_len -
        prompt tokens; OpenAI's default). ``stop_token_ids``: added to ``params.stop_token_ids`` (the engine
        finishes the request with reason ``stop`` at the step that produces one; that token is its last).
        ``prefill_after``: the id of a request with the same prompt submitted just before (a sibling of
        ``n > 1``); this one waits for that one's prefill and reuses its full KV blocks (prefix cache).
        ``prompt_options`` (vLLM's fields, :meth:`encode`): add_generation_prompt, continue_final_message,
        add_special_tokens, truncate_prompt_tokens with truncation_side. ``handle.prompt_token_ids`` is the
        prompt as submitted to the engine.
        ``group``: the id of the first worker request of the same HTTP request (``n`` x prompts); the queue and
        the running slots are shared fairly among groups (:mod:`serve.core.fair`). None: its own id.
        Token events carry ``logprob`` (``[id, log-prob, rank, [[id, log-prob], ...]]``) when
        ``params.logprobs`` is set; the first carries ``prompt_logprobs`` when ``params.prompt_logprobs`` is.

        Raises ``engine.RequestError`` for a prompt the engine cannot take, :class:`DuplicateRequest`
        for a live request id, :class:`WorkerUnavailable` when not accepting work.
        """
        token_ids, params, tags = self._checked(prompt, params, request_id, tags, fill_context, stop_token_ids,
                                                prompt_options)
        with self._lock:
            if not self.accepting:
                raise WorkerUnavailable(self._unavailable_reason())
            rid = str(request_id) if request_id is not None else self._new_id()
            if rid in self._live or rid in self.output.requests:     # the owner's, or its outputs not yet out
                raise DuplicateRequest(f"request_id {rid!r} is already in flight")
            handle = RequestHandle(rid, stream_buffer or self.config.stream_buffer, keep_tokens=stream)
            handle.prompt_token_ids = token_ids
            group = str(group) if group else rid
            step, size = self.current_round(), self.config.queue_size
            submitted = Submitted(rid, step, now_ns(), len(token_ids), params.max_tokens, len(self._pending), tags)
            self.output.add(handle, len(token_ids), submitted.t_ns, group, params.max_tokens,
                            params.n if prefill_after is None else 0)
            if not self._groups.has_room(group, size):      # the queue counts groups: serve.core.fair
                handle.rejected = True
                self.output.process([submitted, Finished(rid, step, now_ns(), "rejected",
                                                         message=f"queue full ({size} requests waiting)")])
                return handle
            try:
                self._enqueue(rid, token_ids, params, prefill_after, group)
            except BaseException:
                self.output.requests.pop(rid, None)
                raise
            self.output.process([submitted])
        return handle

    def _checked(self, prompt, params: SamplingParams | None, request_id, tags: dict | None, fill_context: bool,
                 stop_token_ids, prompt_options: dict | None = None) -> tuple[list[int], SamplingParams, dict]:
        """What submit() checks before it takes the lock: accepting, the request id's form, the prompt's tokens,
        the engine's admission rule (over the served record: fixed after start), the tags."""
        if not self.accepting:
            raise WorkerUnavailable(self._unavailable_reason())
        params = params or SamplingParams()
        if request_id is not None and not REQUEST_ID_RE.fullmatch(str(request_id)):
            raise RequestError(f"request_id must match {REQUEST_ID_RE.pattern}, got {request_id!r}",
                               "invalid_request_id")
        token_ids = self.encode(prompt, prompt_options)
        changes: dict[str, Any] = {}
        if fill_context:
            changes["max_tokens"] = max(1, self.served.max_model_len - len(token_ids))
        extra = [t for t in stop_token_ids if t not in params.stop_token_ids]
        if extra:
            changes["stop_token_ids"] = [*params.stop_token_ids, *extra]
        if changes:                                 # one rebuild (and one validation), not one per change
            params = dataclasses.replace(params, **changes)
        self.served.check(token_ids, params)
        if params.structured_outputs is not None:
            self._check_grammar(params.structured_outputs)
            feasible.check(self._grammars(), params)        # a grammar that leaves no token: refused here
        tags = dict(tags or {})
        clash = sorted(set(tags) & RESERVED_FIELDS)
        if clash:
            raise RequestError(f"tags may not use the reserved field name(s) {', '.join(clash)}", "invalid_tags")
        return token_ids, params, tags

    def _grammars(self):
        """The grammar compiler and cache submit() checks constraints with: the engine's own where it runs in
        this process (:class:`serve.core.worker.Worker`), else one over the front's tokenizer (None without one:
        the engine then refuses a bad constraint when it admits the request)."""
        if self._grammar_cache is None and self._encoder is not None:
            from engine.sampling.structured import Grammars
            cfg = self.served.config
            mine = self.config
            self._grammar_cache = Grammars(lambda: self._encoder, cfg.vocab_size, tuple(cfg.eos_token_ids),
                                           cache_bytes=mine.grammar_cache_mb << 20,
                                           compile_timeout_s=mine.grammar_compile_timeout,
                                           max_grammar_bytes=mine.grammar_max_mb << 20)
        return self._grammar_cache

    def _check_grammar(self, so) -> None:
        """Compile a structured-output constraint at submit, off the step loop (pinned on the request: the
        engine's admission finds it compiled); one xgrammar refuses, or past the compile budget, is the engine's
        RequestError (400). A constraint :meth:`compile_grammar` compiled is found pinned at once."""
        grammars = self._grammars()
        if grammars is None:
            return
        self._build_compiler(grammars)
        grammars.compile(so)

    def _build_compiler(self, grammars) -> None:
        with self._encode_lock:             # building the compiler reads (and encodes with) the tokenizer
            grammars.compiler

    async def compile_grammar(self, so) -> None:
        """Compile a structured-output constraint in the grammar compiler's own workers while the event loop
        waits (no thread of the pool that prepares text requests is held), so that submit() finds it pinned;
        the same refusals as submit()."""
        grammars = self._grammars()
        if grammars is None:
            return
        if grammars._compiler is None:
            import asyncio
            await asyncio.get_running_loop().run_in_executor(None, self._build_compiler, grammars)
        await grammars.compile_async(so)

    def _new_id(self) -> str:
        while True:
            rid = f"{self.worker_id}-{secrets.token_hex(8)}"
            if rid not in self._live:
                return rid

    # -- encoding ------------------------------------------------------------------------------
    def encode(self, prompt, options: dict | None = None) -> list[int]:
        """Token ids of a prompt: text, chat messages (chat template) or token ids; ``options`` (vLLM's):
        the template's add_generation_prompt / continue_final_message, add_special_tokens, and
        truncate_prompt_tokens (keep the last k tokens, or the first k with truncation_side "right")."""
        options = dict(options or {})
        keep, side = options.pop("truncate_prompt_tokens", None), options.pop("truncation_side", "left")
        ids = self._encode(prompt, options)
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:] if side == "left" else ids[:keep]
        return ids

    def _encode(self, prompt, options: dict) -> list[int]:
        if isinstance(prompt, list) and (set(map(type, prompt)) == {int}          # token ids, at C speed
                                         or all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            return list(prompt)
        if self._encoder is None:
            raise RequestError("this worker was started without a tokenizer: send token ids")
        limit = self.config.max_prompt_bytes
        if isinstance(prompt, list):                # chat messages (the native route): the template's defaults
            prompt = ChatPrompt(prompt)
        if isinstance(prompt, str):
            _check_size(len(prompt.encode("utf-8", "surrogatepass")), limit, "the prompt")
        elif isinstance(prompt, ChatPrompt):
            _check_size(sum(len(c.encode("utf-8", "surrogatepass")) for c in prompt.contents())
                        + len(prompt.structure_text().encode("utf-8", "surrogatepass")), limit, "the messages")
        try:
            with self._encode_lock:                 # fast tokenizers are not safe to share between threads
                if isinstance(prompt, ChatPrompt):
                    return self._encode_chat(prompt, limit, options)
                return self._tokenize(prompt, **options)
        except RequestError:
            raise
        except Exception as e:                      # a chat template that cannot render these messages
            raise RequestError(f"cannot encode the prompt: {type(e).__name__}: {' '.join(str(e).split())[:200]}",
                               "invalid_prompt") from None

    def _encode_chat(self, chat: ChatPrompt, limit: int, options: dict) -> list[int]:
        """The chat template's text (:func:`serve.protocol.chat.render`: tools, template kwargs, the
        template's own thinking default, vLLM's add_generation_prompt / continue_final_message in ``options``),
        tokenized so that only the template's own markers are special tokens.

        The template is rendered once with a unique sentinel around every message's content; the text
        outside the sentinels is tokenized as the template made it (its markers become control tokens),
        the content between them with special tokens split into plain text. When no content spells a
        special token this is exactly the engine's encoding of the rendered text. Tool schemas and tool-call
        arguments are written by the template outside the contents: one that spells a special token is refused."""
        tok = self._encoder
        specials = [t for t in (getattr(tok, "all_special_tokens", None) or []) if t]
        contents = chat.contents()
        if self.config.special_tokens_in_content:
            return self._tokenize(render(tok, chat, **_template_options(options)), **options)
        structure = chat.structure_text()
        if any(sp in structure for sp in specials):
            raise RequestError("tools, tool-call arguments and chat_template_kwargs may not spell a special token "
                               "(start the server with --special-tokens-in-content)", "invalid_prompt")
        if not any(sp in c for c in contents for sp in specials):
            return self._tokenize(render(tok, chat, **_template_options(options)), **options)
        mark = "\u2063" + secrets.token_hex(8)
        wrapped = [{**m, "content": f"{mark}{c}{mark}"} for m, c in zip(chat.messages, contents)]
        text = render(tok, dataclasses.replace(chat, messages=wrapped), **_template_options(options))
        parts = text.split(mark)
        if len(parts) != 2 * len(chat.messages) + 1:
            raise RequestError("the chat template rewrites message content; cannot keep special tokens in it as text "
                               "(start the server with --special-tokens-in-content)", "invalid_prompt")
        _check_size(sum(len(p.encode("utf-8")) for p in parts), limit, "the rendered chat")
        ids: list[int] = []
        for i, part in enumerate(parts):
            if not part:
                continue
            if i % 2:          # message content: special-token text stays text
                ids += tok.encode(part, add_special_tokens=False, split_special_tokens=True)
            else:              # the template's own text
                ids += tok.encode(part, add_special_tokens=False)
        return tok.build_inputs_with_special_tokens(ids) if options.get("add_special_tokens") else ids

    # -- what the front end reads ----------------------------------------------------------------
    def gauges(self) -> dict[str, float]:
        s = self.snapshot()
        return {
            "labkit_num_requests_waiting": s.get("queue_depth", 0),
            "labkit_num_requests_running": s.get("active", 0),
            "labkit_engine_waiting": s.get("engine_waiting", 0),
            "labkit_engine_running": s.get("engine_running", 0),
            "labkit_kv_blocks_total": s.get("kv_blocks_total", 0),
            "labkit_kv_blocks_used": s.get("kv_blocks_used", 0),
            "labkit_kv_blocks_free": s.get("kv_blocks_free", 0),
            "labkit_round": s.get("round", 0),
            "labkit_healthy": 1 if s["state"] == "ok" else 0,
            "labkit_triton_compiles_after_startup": s.get("triton_compiles_after_startup", 0),
            # the engine's running totals, turned into vLLM's counters at each scrape (metrics.VllmSeries)
            "engine_preemptions": s.get("engine_preemptions", 0),
            "prefix_cache_queries": s.get("prefix_cache_queries", 0),
            "prefix_cache_hits": s.get("prefix_cache_hits", 0),
        }

    def header(self, envelope: Callable[..., dict] | None = None, **extra) -> dict:
        """The header of a JSONL log written from this worker (after start): ``envelope(kind=, device=, model=,
        seed=, engine=)`` over the served engine's identity (the lab gives its evidence envelope), else
        :func:`serve.observe.events.basic_envelope`."""
        from serve.observe.events import basic_envelope

        s = self.served
        env = (envelope or basic_envelope)(kind=s.kind, device=s.device, model=s.model, seed=s.seed,
                                           engine=s.describe())
        return {**env, "worker": self.config.flat(), **extra}


def _template_options(options: dict) -> dict:
    """The prompt options the chat template itself takes (vLLM's assistant prefill)."""
    return {k: options[k] for k in ("add_generation_prompt", "continue_final_message") if k in options}


def _check_size(n: int, limit: int, what: str) -> None:
    if n > limit:
        raise RequestError(f"{what} has {n} bytes; this server tokenizes at most {limit} "
                           f"(--max-prompt-bytes)", "prompt_too_long")
