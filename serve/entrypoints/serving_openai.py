"""The OpenAI-compatible routes: ``POST /v1/completions`` and ``POST /v1/chat/completions``, streamed (SSE
``data: {...}`` ... ``data: [DONE]``) or as one JSON object (vLLM's ``serving_completion`` and ``serving_chat``).

A route parses the body, submits one worker request per prompt and sample (:meth:`OpenAIRoutes.submit_all`)
and hands them to an :class:`OpenAIResponse`, which reads their events (:meth:`OpenAIResponse.consume`),
turns token ids into text through the stop strings, and answers (:meth:`OpenAIResponse.stream` or
:meth:`OpenAIResponse.collect`). The two APIs differ only in the shapes of their chunks and choices:
:class:`ChatFormat` and :class:`CompletionFormat`.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any, Callable

from aiohttp import web

from serve.protocol import requests as protocol
from serve.protocol import vllm_fields as vf
from serve.protocol.chat_output import ChatOutput, read_message
from serve.protocol.reasoning import opened_in_prompt
from serve.entrypoints.detokenize import IncrementalText, LogprobsFormat, StopStrings
from serve.entrypoints.http import ClientGone, json_bytes
from serve.observe.logsafe import install as escape_log
from serve.protocol.requests import GenRequest
from serve.entrypoints.serving import Serving
from serve.core.stream import RequestHandle
from serve.protocol.wire import ApiError

ACCESS_LOG = logging.getLogger("labkit.access")      # one line per generation request (vLLM's habit)
escape_log(ACCESS_LOG)                               # every value in it escaped: one line per request
_SENTINEL = "\x00"                       # a piece no token text is: its JSON marks where a chunk's text goes
_SENTINEL_JSON = json_bytes(_SENTINEL)


class CompletionFormat:
    """``/v1/completions``' shapes: ``text_completion`` objects with ``text`` choices."""
    chat = False
    id_prefix = "cmpl"
    final_object = chunk_object = "text_completion"

    @staticmethod
    def chunk_choice(index: int, piece: str | None, finish: str | None, first: bool, lp: dict | None) -> dict:
        return {"index": index, "text": piece or "", "logprobs": lp, "finish_reason": finish}

    @staticmethod
    def final_choice(index: int, text: str, lp: dict | None, finish: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}

    @staticmethod
    def finish_piece(tail: str) -> str | None:
        return tail


class ChatFormat:
    """``/v1/chat/completions``' shapes: ``delta`` chunks (the first names the role), ``message`` choices."""
    chat = True
    id_prefix = "chatcmpl"
    final_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    @staticmethod
    def chunk_choice(index: int, piece: str | None, finish: str | None, first: bool, lp: dict | None) -> dict:
        delta: dict = {"role": "assistant"} if first else {}
        if piece is not None:
            delta["content"] = piece
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}

    @staticmethod
    def final_choice(index: int, text: str, lp: dict | None, finish: str | None) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                "finish_reason": finish}

    @staticmethod
    def finish_piece(tail: str) -> str | None:
        return tail or None


@dataclass
class Choice:
    """One prompt's request inside an OpenAI answer."""
    index: int
    handle: RequestHandle
    text: IncrementalText
    stops: StopStrings
    pieces: list = dataclasses.field(default_factory=list)
    tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish: str | None = None
    error: str | None = None
    result: dict | None = None
    ttft: float | None = None
    tail: str = ""
    lp_items: list = dataclasses.field(default_factory=list)   # per-token log-prob items (LogprobsFormat.item)
    text_offset: int = 0                                       # completions: where the next token's text starts
    output: ChatOutput | None = None                           # chat: reasoning / tool calls read off the text
    token_ids: list = dataclasses.field(default_factory=list)  # every generated token (return_token_ids)
    chunk_ids: list = dataclasses.field(default_factory=list)  # the tokens of the chunk being made (streams)
    prompt_lps: list | None = None                             # the worker's prompt log-probs (sample 0 of a prompt)
    started: bool = False                                      # a chunk of this choice was sent (streams)


class OpenAIRoutes:
    """The two OpenAI routes over the shared serving path."""

    def __init__(self, serving: Serving):
        self.serving = serving
        served, name = serving.served, serving.limits.served_model_name
        ident = json.dumps([name, served.model, served.describe()], sort_keys=True, default=str)
        self.system_fingerprint = "fp_" + hashlib.sha256(ident.encode()).hexdigest()[:12]

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, protocol.parse_completion, CompletionFormat)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, protocol.parse_chat, ChatFormat)

    async def _route(self, request: web.Request, parse: Callable, fmt) -> web.StreamResponse:
        t0 = time.monotonic()
        try:
            req = await self.serving.parse(request, parse)
        except ApiError as e:          # refused before it became a request: still one access line
            if ACCESS_LOG.isEnabledFor(logging.INFO):
                ACCESS_LOG.info("%s - status=%d total=%.1fms error=%s param=%s", req_api(fmt), e.status,
                                (time.monotonic() - t0) * 1e3, e.code, e.param)
            raise
        handles = await self.submit_all(req)
        return await OpenAIResponse(self, req, request, handles, fmt).answer()

    async def submit_all(self, req: GenRequest) -> list[RequestHandle]:
        """One worker request per prompt (a list of prompts in /v1/completions) and sample (n); all or none.
        Choice prompt_i * n + j is prompt i's sample j: seed + j when a seed is given, and it waits for
        sample 0's prefill so that it reuses the prompt's full KV blocks through the prefix cache."""
        prompts = req.prompts or [req.prompt]
        handles: list[RequestHandle] = []
        try:
            for i, prompt in enumerate(prompts):
                for j in range(req.n):
                    k = i * req.n + j
                    rid = req.request_id if k == 0 or req.request_id is None else f"{req.request_id}-{k}"
                    params = req.params if req.n == 1 else dataclasses.replace(req.params, n=req.n)   # the metrics' n
                    if j:
                        params = dataclasses.replace(params, prompt_logprobs=None,
                                                     seed=None if params.seed is None else params.seed + j)
                    one = dataclasses.replace(req, prompt=prompt, request_id=rid, prompts=None, params=params)
                    try:
                        handles.append(await self.serving.submit(one, handles[-1].request_id if j else None,
                                                                 handles[0].request_id if handles else None))
                    except ApiError as e:
                        if len(prompts) > 1 and e.param == "prompt":
                            e.param = f"prompt[{i}]"
                        raise
        except BaseException:
            for h in handles:
                self.serving.abandon(h)
            raise
        return handles


def req_api(fmt) -> str:
    return "chat" if fmt.chat else "completions"


def _finish_reason(finished: dict) -> str:
    reason = finished.get("reason")
    return reason if reason in ("stop", "length") else "abort"


class OpenAIResponse:
    """One OpenAI request's answer: its choices' events read, detokenized through the stop strings, and sent
    as SSE chunks (:meth:`stream`) or one JSON object (:meth:`collect`)."""

    def __init__(self, routes: OpenAIRoutes, req: GenRequest, request: web.Request, handles: list[RequestHandle],
                 fmt):
        sv = routes.serving
        self.serving, self.req, self.request, self.fmt = sv, req, request, fmt
        tok = sv.worker.tokenizer
        self.choices = [Choice(i, h, IncrementalText(tok), StopStrings(req.stop, req.include_stop_str_in_output))
                        for i, h in enumerate(handles)]
        self.logprobs = LogprobsFormat(tok, fmt.chat, req.vllm.return_tokens_as_token_ids) \
            if req.logprobs is not None else None
        self.vllm = req.vllm
        self._templated = not (req.vllm.return_token_ids or req.vllm.continuous_usage_stats)
        self.read = req.chat_output if fmt.chat and req.chat_output is not None and req.chat_output.active else None
        if self.read is not None:
            # the template opened <think>: the answer starts in the reasoning, unless a grammar shapes it from
            # its first token (structured outputs, a required / named tool call: that text is the answer)
            if self.read.reasoning and req.params.structured_outputs is None \
                    and opened_in_prompt(tok, handles[0].prompt_token_ids):
                self.read = dataclasses.replace(self.read, think_opened=True)
            for c in self.choices:
                c.output = ChatOutput(self.read)
        self.prompts = req.prompts or [req.prompt]
        self.head = {"id": f"{fmt.id_prefix}-{handles[0].request_id}", "object": fmt.chunk_object,
                     "created": int(time.time()), "model": sv.limits.served_model_name,
                     "system_fingerprint": routes.system_fingerprint}
        # echo with logprobs: sample 0 of each prompt carries the prompt's log-probs; its siblings wait for them
        self._prompt_lps: dict[int, list | None] = {}
        self._prompt_lps_ready = {i: asyncio.Event() for i in range(len(self.prompts))}
        self._templates: dict[int, tuple[bytes, bytes] | None] = {}
        self.t0 = time.monotonic()
        self.status = 200

    async def answer(self) -> web.StreamResponse:
        """Stream or collect; one access line whatever happens."""
        try:
            return await (self.stream() if self.req.stream else self.collect())
        except ApiError as e:
            self.status = e.status
            raise
        except ClientGone:
            self.status = 499
            raise
        finally:
            self._access_line()

    # -- shapes ----------------------------------------------------------------------------
    def chunk(self, index: int, piece: str | None, finish: str | None, first: bool = False,
              logprobs: list | None = None) -> dict:
        lp = self.logprobs.obj(logprobs) if self.logprobs is not None and logprobs else None
        body = {**self.head, "choices": [self.fmt.chunk_choice(index, piece, finish, first, lp)]}
        if self.req.include_usage:
            body["usage"] = self.usage(so_far=True) if self.vllm.continuous_usage_stats else None
        if self.vllm.return_token_ids and index < len(self.choices):
            self._chunk_token_ids(body, self.choices[index], first)
        return body

    def delta_chunks(self, c: Choice, piece: str, logprobs: list | None = None, end: bool = False) -> list[dict]:
        """A chat choice's piece of text through its reasoning / tool-call reader: a chunk per delta (the
        first carries the piece's log-probs and token ids; an empty content delta when the reader holds the
        piece back)."""
        deltas = c.output.push(piece) + (c.output.finish(cut=c.finish == "length") if end else [])
        if not deltas and not end:
            deltas = [{"content": ""}]
        lp = self.logprobs.obj(logprobs) if self.logprobs is not None and logprobs else None
        out = []
        for i, delta in enumerate(deltas):
            body = {**self.head, "choices": [{"index": c.index, "delta": delta, "logprobs": lp if i == 0 else None,
                                              "finish_reason": None}]}
            if self.req.include_usage:
                body["usage"] = self.usage(so_far=True) if self.vllm.continuous_usage_stats else None
            if self.vllm.return_token_ids and i == 0:
                self._chunk_token_ids(body, c, False)
            out.append(body)
        return out

    def _chunk_token_ids(self, body: dict, c: Choice, first: bool) -> None:
        """return_token_ids in a stream, as vLLM: the chunk's own tokens on its choice; the prompt's ids on the
        first chunk (chat: of the response, with the role; completions: of each choice)."""
        choice = body["choices"][0]
        choice["token_ids"], c.chunk_ids = c.chunk_ids, []
        if self.fmt.chat and first:
            body["prompt_token_ids"] = c.handle.prompt_token_ids
        elif not self.fmt.chat and not c.started:
            choice["prompt_token_ids"] = c.handle.prompt_token_ids
        c.started = True

    def token_chunk(self, index: int, piece: str, logprobs: list | None) -> bytes:
        """chunk(index, piece, None) as json_bytes writes it; without log-probs from a per-choice template
        (the JSON around the piece, made once), the piece's JSON string set in."""
        if self._templated and not (self.logprobs is not None and logprobs):
            if index not in self._templates:
                parts = json_bytes(self.chunk(index, _SENTINEL, None)).split(_SENTINEL_JSON)
                self._templates[index] = (parts[0], parts[1]) if len(parts) == 2 else None
            template = self._templates[index]
            if template is not None:
                try:
                    return template[0] + encode_basestring(piece).encode("utf-8") + template[1]
                except UnicodeEncodeError:
                    pass
        return json_bytes(self.chunk(index, piece, None, logprobs=logprobs))

    def usage(self, so_far: bool = False) -> dict:
        """The request's usage; ``so_far`` (continuous_usage_stats): the tokens produced until now."""
        n = self.req.n
        if so_far:
            p = sum(len(c.handle.prompt_token_ids or ()) for c in self.choices if c.index % n == 0)
            done = sum(c.completion_tokens if c.finish else c.tokens for c in self.choices)
            return {"prompt_tokens": p, "completion_tokens": done, "total_tokens": p + done}
        p = sum(c.prompt_tokens for c in self.choices if c.index % n == 0)     # a prompt counts once (n > 1)
        done = sum(c.completion_tokens for c in self.choices)
        return {"prompt_tokens": p, "completion_tokens": done, "total_tokens": p + done}

    # -- reading the events ------------------------------------------------------------------
    async def consume(self, c: Choice, emit: Callable | None, flush: Callable | None = None) -> None:
        """One choice's events: text through the stop strings to ``emit(index, text, logprobs)`` (streams),
        and ``flush()`` after each wake-up's batch (one write for the batch's chunks)."""
        async for batch in self.serving.batches(c.handle, self.request):
            if await self._consume_batch(c, batch, emit):
                return
            if flush is not None:
                await flush()

    async def _consume_batch(self, c: Choice, batch: list[dict], emit: Callable | None) -> bool:
        """True once the choice is done (finished, error, or a stop string matched). A token's text goes
        through the stop strings to ``emit`` (the per-token path: inline, no call per token)."""
        lp, stops, text = self.logprobs, c.stops, c.text
        for ev in batch:
            kind = ev["event"]
            if kind == "token":
                if c.ttft is None:
                    c.ttft = time.monotonic() - self.t0
                    if self.req.echo:                # the prompt (and its log-probs) before the first token
                        await self._echo_first(c, ev, emit)
                c.tokens += 1
                c.token_ids.append(ev["token_id"])
                c.chunk_ids = [ev["token_id"]]
                if "prompt_logprobs" in ev:
                    c.prompt_lps = ev["prompt_logprobs"]
                out = stops.push(text.push(ev["token_id"]))
                c.pieces.append(out)
                items = [lp.item(ev["logprob"], c)] if lp is not None and "logprob" in ev else []
                c.lp_items += items
                if emit is not None:            # one chunk per token (load clients time them), maybe ""
                    emit(c.index, out, items)
                if stops.matched is not None:   # the reader found the end: finish it as "stop"
                    self.serving.worker.cancel(c.handle.request_id, cause="stop_string", reason="stop")
                    c.finish, c.completion_tokens = "stop", c.tokens
                    return True
            elif kind == "submitted":
                c.prompt_tokens = ev.get("prompt_tokens", 0)
            elif kind == "finished":
                self._on_finished(c, ev)
                return True
        return False

    def _on_finished(self, c: Choice, ev: dict) -> None:
        if self.req.echo and c.index % self.req.n == 0:
            self._prompt_lps_ready[c.index // self.req.n].set()       # no token came: siblings stop waiting
        c.result = ev
        if ev.get("reason") == "error":
            c.error = ev.get("message") or "engine error"
            return
        c.tail = c.stops.push(c.text.flush()) + c.stops.flush()    # sent with the finish chunk
        c.pieces.append(c.tail)
        c.finish = _finish_reason(ev)
        c.completion_tokens = ev.get("num_completion_tokens", c.tokens)
        c.prompt_tokens = ev.get("num_prompt_tokens", c.prompt_tokens)

    async def _echo_first(self, c: Choice, ev: dict, emit: Callable | None) -> None:
        """completions echo, before the first token: the prompt's text (and its log-probs)."""
        text, items = self._echo(c, await self._echo_logprobs(c, ev))
        c.pieces.append(text)
        c.lp_items += items
        if emit is not None:
            emit(c.index, text, items)

    async def _echo_logprobs(self, c: Choice, ev: dict | None) -> list | None:
        i, j = divmod(c.index, self.req.n)
        if j == 0:
            self._prompt_lps[i] = (ev or {}).get("prompt_logprobs")
            self._prompt_lps_ready[i].set()
        else:
            await self._prompt_lps_ready[i].wait()
        return self._prompt_lps.get(i)

    def _echo(self, c: Choice, prompt_logprobs: list | None) -> tuple[str, list]:
        """completions echo: the prompt's text, and with logprobs its tokens (the first has no log-prob). Chat
        echo (vLLM's): the last message's content when it has the answer's role, text only."""
        if self.fmt.chat:
            return vf.chat_echo(self.req.prompt.messages, self.vllm.add_generation_prompt), []
        prompt = self.prompts[c.index // self.req.n]
        worker = self.serving.worker
        ids = c.handle.prompt_token_ids or worker.encode(prompt)    # as submitted (truncate_prompt_tokens)
        if isinstance(prompt, str) and self.vllm.truncate_prompt_tokens is None:
            text = prompt
        else:
            text = worker.tokenizer.decode(ids, skip_special_tokens=True)
        if self.logprobs is None or prompt_logprobs is None:
            c.text_offset += len(text)
            return text, []
        return text, [self.logprobs.item(entry, c, token_id=t) for t, entry in zip(ids, prompt_logprobs)]

    # -- answering ---------------------------------------------------------------------------
    async def _each_choice(self, run: Callable) -> None:
        """``run(choice)`` for every choice at once; when one fails (or the client goes), the rest are cancelled."""
        tasks = [asyncio.ensure_future(run(c)) for c in self.choices]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()

    async def collect(self) -> web.Response:
        """Every choice to its end, then one JSON object (500 engine error, 503 shut down first)."""
        try:
            await self._each_choice(lambda c: self.consume(c, None))
        finally:
            for c in self.choices:
                self.serving.abandon(c.handle)
        for c in self.choices:
            if c.error is not None:
                raise ApiError(500, f"the engine failed on this request: {c.error}", "engine_error")
            if (c.result or {}).get("reason") == "cancelled" and (c.result or {}).get("cause") == "shutdown":
                raise ApiError(503, "the server shut down before the request finished", "shutdown")
        lp = self.logprobs
        out = [self.fmt.final_choice(c.index, "".join(c.pieces), lp.obj(c.lp_items) if lp is not None else None,
                                     c.finish) for c in self.choices]
        if self.read is not None:          # the message as the reasoning / tool-call reader sees the text
            for choice in out:
                choice["message"], reader = read_message(self.read, choice["message"]["content"],
                                                         cut=choice["finish_reason"] == "length")
                choice["finish_reason"] = reader.finish_reason(choice["finish_reason"])
        body = {**self.head, "object": self.fmt.final_object, "choices": out, "usage": self.usage()}
        self._vllm_fields(body)
        return web.Response(body=json_bytes(body), content_type="application/json",
                            headers={"X-Request-Id": self.choices[0].handle.request_id,
                                     "X-Worker-Id": self.serving.worker.worker_id})

    def _vllm_fields(self, body: dict) -> None:
        """return_token_ids and prompt_logprobs on a whole answer, in vLLM's places: chat on the response (the
        prompt's) and each choice (its tokens); completions on each choice (a prompt's own ids and log-probs)."""
        n, decode = self.req.n, self.serving.worker.tokenizer.decode
        lead = {c.index: self.choices[c.index - c.index % n] for c in self.choices}     # sample 0 of its prompt
        if self.fmt.chat:
            if self.vllm.return_token_ids:
                body["prompt_token_ids"] = self.choices[0].handle.prompt_token_ids
            if self.vllm.prompt_logprobs is not None:
                body["prompt_logprobs"] = vf.prompt_logprobs_json(self.choices[0].prompt_lps, lambda t: decode([t]))
        for c, choice in zip(self.choices, body["choices"]):
            if self.vllm.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
                if not self.fmt.chat:
                    choice["prompt_token_ids"] = c.handle.prompt_token_ids
            if self.vllm.prompt_logprobs is not None and not self.fmt.chat:
                choice["prompt_logprobs"] = vf.prompt_logprobs_json(lead[c.index].prompt_lps, lambda t: decode([t]))

    async def stream(self) -> web.StreamResponse:
        """SSE: a chunk per token (the chat's role chunk first), a finish chunk per choice, usage, [DONE]."""
        sv = self.serving
        resp = web.StreamResponse(headers=sv.headers(self.choices[0].handle, **{"Content-Type": "text/event-stream",
                                                                                "Cache-Control": "no-cache"}))
        sv.http.cors(self.request, resp)
        out = _SseWriter(resp)
        try:
            await resp.prepare(self.request)
            if self.fmt.chat:
                for c in self.choices:
                    await out.send(self.chunk(c.index, "", None, first=True))
            await self._each_choice(lambda c: self._stream_choice(c, out))
            if self.req.include_usage and all(c.finish is not None for c in self.choices):
                await out.send({**self.chunk(0, None, None), "choices": [], "usage": self.usage()})
            await out.send("[DONE]")
            await resp.write_eof()
        except (ClientGone, ConnectionError):
            self.status = 499
        finally:
            for c in self.choices:
                sv.abandon(c.handle)
        return resp

    async def _stream_choice(self, c: Choice, out: "_SseWriter") -> None:
        pending, token_chunk = out.pending, self.token_chunk

        def emit(index: int, piece: str, logprobs: list | None = None) -> None:
            if c.output is not None:
                pending.extend(b"data: " + json_bytes(ch) + b"\n\n" for ch in self.delta_chunks(c, piece, logprobs))
                return
            pending.append(b"data: " + token_chunk(index, piece, logprobs) + b"\n\n")

        await self.consume(c, emit, out.flush)
        await out.flush()
        if c.error is not None:
            await out.send({"error": ApiError(500, f"the engine failed on this request: {c.error}",
                                              "engine_error").body()["error"]})
        elif c.finish is not None and c.output is not None:
            for ch in self.delta_chunks(c, c.tail, end=True):
                await out.send(ch)
            await out.send(self.chunk(c.index, None, c.output.finish_reason(c.finish)))
        elif c.finish is not None:
            await out.send(self.chunk(c.index, self.fmt.finish_piece(c.tail), c.finish))

    def _access_line(self) -> None:
        """The access log line of one generation request: id, status, tokens in and out, TTFT, total time."""
        if not ACCESS_LOG.isEnabledFor(logging.INFO):
            return
        choices = self.choices
        prompt = sum(c.prompt_tokens for c in choices)
        done = sum(c.completion_tokens or c.tokens for c in choices)
        ttfts = [c.ttft for c in choices if c.ttft is not None]
        ttft = f"{min(ttfts) * 1e3:.1f}ms" if ttfts else "-"
        finish = ",".join(str(c.finish or "-") for c in choices)
        ACCESS_LOG.info("%s %s status=%d prompt_tokens=%d output_tokens=%d ttft=%s total=%.1fms finish=%s",
                        self.req.api, choices[0].handle.request_id, self.status, prompt, done, ttft,
                        (time.monotonic() - self.t0) * 1e3, finish)


class _SseWriter:
    """SSE events in order: chunks gather in ``pending`` and leave in one write per flush."""

    def __init__(self, resp: web.StreamResponse):
        self.resp = resp
        self.pending: list[bytes] = []
        self._lock = asyncio.Lock()

    async def flush(self) -> None:
        async with self._lock:
            if self.pending:
                data = b"".join(self.pending)
                self.pending.clear()
                await self.resp.write(data)

    async def send(self, obj: Any) -> None:
        data = obj.encode() if isinstance(obj, str) else json_bytes(obj)
        self.pending.append(b"data: " + data + b"\n\n")
        await self.flush()
