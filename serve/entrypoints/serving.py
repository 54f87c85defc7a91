"""What the native and the OpenAI routes share (vLLM's serving base): one submission path with one mapping of
the worker's refusals to HTTP errors, the answer's headers, a request's events as the batches one wake-up
brings, and the cancel of a request its client left.

A route reads like mini-sglang's: parse the body (:mod:`serve.protocol.requests`), one call here, respond.
Every answer to a generation carries ``X-Request-Id`` and ``X-Cancel-Token``; the token is random and only the
client that sent a request can cancel it (``/cancel`` needs both). The id is that of the answer's first choice;
a cancel of it stops every choice of the request (``n`` x prompts), as a client that goes away does.
"""
from __future__ import annotations

import asyncio
import secrets
from typing import Any, Callable

from aiohttp import web

from engine import RequestError
from engine.sampling.structured import DaemonWorkers
from serve.protocol import requests as protocol
from serve.core.front import DuplicateRequest, ServedEngine, WorkerFront, WorkerUnavailable
from serve.entrypoints.http import BODY_BYTES, INLINE_BODY_BYTES, ClientGone, Middleware, disconnected
from serve.protocol.requests import GenRequest, Limits
from serve.core.stream import RequestHandle
from serve.protocol.wire import ApiError

POLL_S = 0.5          # how often a waiting handler checks that its client is still there
#: fields whose reading can take long (tools' schemas, the tool-call grammar built from them, constraints)
HEAVY_FIELDS = ("tools", "response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                "guided_grammar", "structural_tag")
RETRY_AFTER_S = "1"
_CODE_PARAMS = {"invalid_request_id": "request_id", "invalid_tags": "tags", "invalid_sampling_params": None}


class Serving:
    """The worker, the served engine's record and limits, and the submission path both APIs use."""

    def __init__(self, worker: WorkerFront, limits: Limits, http: Middleware):
        self.worker = worker
        self.served: ServedEngine = worker.served
        self.limits = limits
        self.http = http
        self._cancel_tokens: dict[str, str] = {}          # live HTTP requests: request id -> cancel token
        self._members: dict[str, list[str]] = {}          # first choice's id -> every live choice's id
        self._group_of: dict[str, str] = {}               # a live choice's id -> its first choice's id

    async def parse(self, request: web.Request, parse: Callable[[Any, Limits], GenRequest]) -> GenRequest:
        """The request's body read and parsed (``parse(body, limits)``, ApiError when refused). A large body,
        or one with tools or a constraint, is parsed in a worker thread, so the event loop goes on answering
        (``/health`` and every other request) while the JSON, the tools' schemas and the tool-call grammar
        are read; a small plain one is parsed at once, in arrival order."""
        body = await self.http.read_json(request)
        if request.get(BODY_BYTES, 0) > INLINE_BODY_BYTES or \
                (isinstance(body, dict) and any(k in body for k in HEAVY_FIELDS)):
            return await asyncio.get_running_loop().run_in_executor(_preparer(), parse, body, self.limits)
        return parse(body, self.limits)

    async def submit(self, req: GenRequest, prefill_after: str | None = None,
                     group: str | None = None) -> RequestHandle:
        """The worker's handle for ``req``, or the ApiError its refusal is (400, 429 queue full, 503). ``group``:
        the request id of the first choice of the same HTTP request (fair admission, one cancel for all)."""
        def call() -> RequestHandle:
            return self.worker.submit(req.prompt, req.params, request_id=req.request_id, tags=req.tags,
                                      fill_context=req.fill_context, prefill_after=prefill_after,
                                      prompt_options=req.vllm.prompt_options(req.api == "chat") or None, group=group)

        try:
            if req.params.structured_outputs is not None:     # compiled in the grammar workers, pinned on the params
                await self.worker.compile_grammar(req.params.structured_outputs)
            if isinstance(req.prompt, list) and (not req.prompt or isinstance(req.prompt[0], int)) \
                    and req.params.structured_outputs is None:
                handle = call()               # token ids: no tokenizer (nor grammar compiler) work, keep arrival order
            else:
                handle = await asyncio.get_running_loop().run_in_executor(None, call)
        except RequestError as e:
            raise refusal(e, req) from None
        except DuplicateRequest as e:
            raise ApiError(400, str(e), "duplicate_request_id", "request_id") from None
        except WorkerUnavailable as e:
            raise ApiError(503, str(e), "unavailable", headers={"Retry-After": RETRY_AFTER_S}) from None
        if handle.rejected:
            msg = (handle.result or {}).get("message", "queue full")
            raise ApiError(429, f"request {handle.request_id} rejected: {msg}; retry later", "queue_full",
                           headers={"Retry-After": RETRY_AFTER_S})
        self._cancel_tokens[handle.request_id] = secrets.token_urlsafe(18)
        lead = group or handle.request_id
        self._group_of[handle.request_id] = lead
        self._members.setdefault(lead, []).append(handle.request_id)
        return handle

    def cancel(self, request_id: str, cause: str = "client") -> bool:
        """Cancel a request and every other choice of the HTTP request it leads; False if none was live."""
        hit = False
        for rid in list(self._members.get(request_id) or [request_id]):
            hit = self.worker.cancel(rid, cause=cause) or hit
        return hit

    def headers(self, handle: RequestHandle, **extra: str) -> dict[str, str]:
        return {"X-Request-Id": handle.request_id, "X-Cancel-Token": self._cancel_tokens.get(handle.request_id, ""),
                "X-Worker-Id": self.worker.worker_id, **extra}

    def cancel_token(self, request_id: str) -> str | None:
        return self._cancel_tokens.get(request_id)

    async def batches(self, handle: RequestHandle, request: web.Request):
        """The handle's events until finished, as the lists one wake-up brings (the last ends with the
        finished event); ClientGone when the client went away meanwhile."""
        while True:
            batch = await handle.aget(POLL_S)
            if not batch:
                if handle.finished and handle.buffered == 0:
                    return
                if disconnected(request):
                    raise ClientGone()
                continue
            for i, ev in enumerate(batch):
                if ev["event"] == "finished":
                    yield batch[:i + 1]
                    return
            yield batch

    async def events(self, handle: RequestHandle, request: web.Request):
        """The handle's events until finished, one by one."""
        async for batch in self.batches(handle, request):
            for ev in batch:
                yield ev

    def abandon(self, handle: RequestHandle | None) -> None:
        """The HTTP side is done with ``handle``: forget its cancel token; a request still running is cancelled."""
        if handle is None:
            return
        rid = handle.request_id
        self._cancel_tokens.pop(rid, None)
        lead = self._group_of.pop(rid, None)
        members = self._members.get(lead) if lead is not None else None
        if members is not None:
            if rid in members:
                members.remove(rid)
            if not members:
                del self._members[lead]
        if not handle.finished:
            self.worker.cancel(handle.request_id, cause="disconnect")


_PREPARE: list[DaemonWorkers] = []


def _preparer() -> DaemonWorkers:
    """The one thread that parses heavy bodies: that work is pure Python, so more threads would not finish
    it sooner, only keep the event loop waiting longer for the interpreter lock. A daemon thread: idle on its
    queue, it never holds a closing server's process (a ThreadPoolExecutor's thread is joined at exit)."""
    if not _PREPARE:
        _PREPARE.append(DaemonWorkers(1, "prepare"))
    return _PREPARE[0]


def refusal(e: RequestError, req: GenRequest) -> ApiError:
    """The engine's (or the worker's) RequestError as a 400 naming the parameter. A sampling parameter the
    engine refuses (its code ``invalid_<param>``, e.g. a stop token id outside the vocabulary) is an
    ``invalid_value`` of that parameter, as protocol's own range checks say it."""
    if e.code == "invalid_structured_outputs":           # a constraint xgrammar cannot compile
        return ApiError(400, str(e), "invalid_value", req.structured_param or "structured_outputs")
    param = protocol.param_of(e.code)
    if param is not None:
        return ApiError(400, str(e), "invalid_value", param)
    param = _CODE_PARAMS.get(e.code, _prompt_param(req))
    return ApiError(400, str(e), e.code, param)


def _prompt_param(req: GenRequest) -> str:
    if req.api == "chat" or (isinstance(req.prompt, list) and req.prompt and isinstance(req.prompt[0], dict)):
        return "messages"
    if req.api == "native" and isinstance(req.prompt, list):
        return "prompt_token_ids"
    return "prompt"
