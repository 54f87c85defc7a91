"""The HTTP client side: one streamed request, recorded as client-observed events.

``labkit client`` and ``labkit load --endpoints`` both go through :func:`stream_native` (our
``/generate`` NDJSON stream) or :func:`stream_openai` (any OpenAI-compatible server: ours, vLLM,
SGLang; SSE chunks). Each records events with ``observer=client`` and ``t_ns`` from this process's
monotonic clock, taken when the bytes were read:

- ``submitted``: just before the request is sent (``round`` is null: the client cannot know the
  server's round; ``worker_id`` is the endpoint's worker as /health named it, when known);
- ``admitted`` / ``token`` / ``finished``: when the server's event (native) or chunk (OpenAI) arrives.

For the native API every server event is also kept, unchanged, as an ``observer=engine`` record
(``log_server_events``), with the server's own ``t_ns``; the two observers are never mixed in one
measurement.

A server started with ``--api-key`` wants ``Authorization: Bearer KEY`` on every route but /health:
:func:`session` sends ``$LABKIT_API_KEY`` (or its ``api_key``). A cancel must carry the request's
``X-Cancel-Token``: :func:`stream_native` keeps it while the stream is open and :func:`cancel` finds it. Over the OpenAI API a streamed chunk counts as one token event (servers send one
chunk per token); the usage block, when the server sends it, gives the exact output count.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp

from labkit.errors import UserError
from labkit.evidence import envelope
from serve.observe.events import EventLog, now_ns

Record = Callable[[dict], None]
API_KEY_ENV = "LABKIT_API_KEY"
JSON_HEADERS = {"Content-Type": "application/json"}

#: (endpoint, request id) -> the X-Cancel-Token of a stream this process has open; None until its headers arrive
_cancel_tokens: dict[tuple[str, str], str | None] = {}


@dataclass
class ClientResult:
    request_id: str
    endpoint: str
    status: int | None = None
    worker_id: str | None = None
    reason: str | None = None
    cause: str | None = None
    message: str | None = None
    tokens: int = 0
    tokens_after_finished: int = 0
    usage_completion_tokens: int | None = None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    submitted_ns: int = 0
    first_token_ns: int | None = None
    finished_ns: int | None = None
    cancel_sent_after: int | None = None

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_ns is None:
            return None
        return (self.first_token_ns - self.submitted_ns) / 1e6

    def summary(self) -> dict:
        return {"request_id": self.request_id, "endpoint": self.endpoint, "status": self.status,
                "worker_id": self.worker_id, "reason": self.reason, "cause": self.cause, "message": self.message,
                "tokens": self.tokens, "tokens_after_finished": self.tokens_after_finished,
                "usage_completion_tokens": self.usage_completion_tokens,
                "ttft_ms": None if self.ttft_ms is None else round(self.ttft_ms, 3), "text": self.text,
                "cancel_sent_after": self.cancel_sent_after}


def _client_event(event: str, rid: str, worker_id: str | None, round_: int | None, **fields) -> dict:
    return {"event": event, "request_id": rid, "worker_id": worker_id, "round": round_, "t_ns": now_ns(),
            "observer": "client", **fields}


def _noop(_: dict) -> None:
    pass


def _error_message(status: int, raw: bytes) -> str:
    try:
        body = json.loads(raw)
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return str(body["error"].get("message"))
        if isinstance(body, dict) and "message" in body:
            return str(body["message"])
    except (ValueError, UnicodeDecodeError):
        pass
    return raw[:200].decode("utf-8", "replace").strip() or f"HTTP {status}"


def session(timeout_s: float = 600.0, limit: int = 1000, api_key: str | None = None) -> aiohttp.ClientSession:
    """A client session; ``api_key`` (default ``$LABKIT_API_KEY``) goes out as ``Authorization: Bearer``."""
    import os

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout_s)
    key = api_key if api_key is not None else os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {key}"} if key else None
    return aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=limit), headers=headers)


async def _get_json(sess: aiohttp.ClientSession, url: str) -> dict | None:
    try:
        async with sess.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200 and not url.endswith("/health"):
                return None
            raw = await resp.read()
            body = json.loads(raw) if raw else None
            return body if isinstance(body, dict) else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def fetch_health(sess: aiohttp.ClientSession, endpoint: str) -> dict | None:
    """The server's /health body, completed with /config where the server shows it to us (ours: kind, device,
    model identity, engine); None if it has none or is not JSON."""
    base = endpoint.rstrip("/")
    health = await _get_json(sess, f"{base}/health")
    if health is None:
        return None
    config = await _get_json(sess, f"{base}/config")
    if config is not None:
        for key in ("model", "engine", "worker"):
            if key in config:
                health.setdefault(key, config[key])
    return health


async def fetch_model_name(sess: aiohttp.ClientSession, endpoint: str) -> str | None:
    try:
        async with sess.get(f"{endpoint.rstrip('/')}/v1/models", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            body = await resp.json(content_type=None)
            return body["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, IndexError, TypeError):
        return None


async def cancel(sess: aiohttp.ClientSession, endpoint: str, request_id: str, cancel_token: str | None = None,
                 wait_s: float = 5.0) -> int:
    """POST /cancel; without ``cancel_token``, the token of this process's open stream of that request (waiting
    up to ``wait_s`` for its headers)."""
    base = endpoint.rstrip("/")
    key = (base, request_id)
    if cancel_token is None and key in _cancel_tokens:
        deadline = asyncio.get_running_loop().time() + wait_s
        while _cancel_tokens.get(key) is None and key in _cancel_tokens \
                and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        cancel_token = _cancel_tokens.get(key)
    body = {"request_id": request_id}
    if cancel_token is not None:
        body["cancel_token"] = cancel_token
    async with sess.post(f"{base}/cancel", json=body) as resp:
        await resp.read()
        return resp.status


def json_body(body: dict) -> bytes:
    """A request body as the compact JSON bytes that go on the wire (``payload=`` of the stream functions): made
    before the clock starts, so a burst's submits do not wait on each other's serialising."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _post(sess: aiohttp.ClientSession, url: str, body: dict, payload: bytes | None):
    if payload is None:
        return sess.post(url, json=body)
    return sess.post(url, data=payload, headers=JSON_HEADERS)


async def stream_native(sess: aiohttp.ClientSession, endpoint: str, body: dict, *, record: Record = _noop,
                        log_server_events: bool = True, cancel_after: int | None = None,
                        tags: dict | None = None, worker_hint: str | None = None,
                        on_text: Callable[[str], None] | None = None, payload: bytes | None = None) -> ClientResult:
    """POST /generate and read its NDJSON stream; ``cancel_after=N`` posts /cancel after token N;
    ``on_text(piece)`` sees each token's text as it arrives.

    ``worker_hint`` (the endpoint's worker id from /health) labels the submitted event, which is
    recorded before the server has answered. ``payload``: ``body`` already serialised (:func:`json_body`),
    sent as it is."""
    rid = body["request_id"]
    res = ClientResult(rid, endpoint)
    tags = tags or {}
    sub = _client_event("submitted", rid, worker_hint, None, **{"endpoint": endpoint, "api": "native",
                                                         "prompt_tokens": _prompt_len(body),
                                                         "max_tokens": body.get("max_tokens"), **tags})
    res.submitted_ns = sub["t_ns"]
    record(sub)
    key = (endpoint.rstrip("/"), rid)
    _cancel_tokens[key] = None
    try:
        async with _post(sess, f"{endpoint.rstrip('/')}/generate", body, payload) as resp:
            res.status = resp.status
            res.worker_id = resp.headers.get("X-Worker-Id")
            if resp.status != 200:
                return _failed(res, resp.status, await resp.read(), record)
            _cancel_tokens[key] = resp.headers.get("X-Cancel-Token")
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        ev = json.loads(line)
                        await _on_native_line(sess, endpoint, ev, res, record, log_server_events, cancel_after)
                        if on_text is not None and ev.get("event") == "token" and ev.get("text"):
                            on_text(ev["text"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        if res.reason is None:
            res.reason, res.message = "error", f"{type(e).__name__}: {e}"
            record(_client_event("finished", rid, res.worker_id, None, reason="error", message=res.message,
                                 num_completion_tokens=res.tokens))
    finally:
        _cancel_tokens.pop(key, None)
    if res.reason is None:
        res.reason, res.message = "error", "the stream ended without a finished event"
        record(_client_event("finished", rid, res.worker_id, None, reason="error", message=res.message,
                             num_completion_tokens=res.tokens))
    return res


async def _on_native_line(sess, endpoint: str, ev: dict, res: ClientResult, record: Record, log_server: bool,
                          cancel_after: int | None) -> None:
    t = now_ns()
    if log_server:
        record({k: v for k, v in ev.items() if k != "text"})
    name = ev.get("event")
    res.worker_id = ev.get("worker_id") or res.worker_id
    base = {"event": name, "request_id": res.request_id, "worker_id": ev.get("worker_id"), "round": ev.get("round"),
            "t_ns": t, "observer": "client", "server_t_ns": ev.get("t_ns")}
    if name == "token":
        if res.reason is not None:
            res.tokens_after_finished += 1
        res.tokens += 1
        res.token_ids.append(ev.get("token_id"))
        res.text += ev.get("text") or ""
        if res.first_token_ns is None:
            res.first_token_ns = t
        record({**base, "index": ev.get("index"), "token_id": ev.get("token_id")})
        if cancel_after is not None and res.tokens == cancel_after and res.cancel_sent_after is None:
            res.cancel_sent_after = res.tokens
            status = await cancel(sess, endpoint, res.request_id)
            record(_client_event("cancel_sent", res.request_id, res.worker_id, ev.get("round"), after_tokens=res.tokens,
                                 status=status))
    elif name == "admitted":
        record({**base, "active": ev.get("active"), "active_before": ev.get("active_before")})
    elif name == "finished":
        res.reason, res.cause, res.message = ev.get("reason"), ev.get("cause"), ev.get("message")
        res.finished_ns = t
        fields = {k: ev[k] for k in ("reason", "cause", "message", "num_prompt_tokens", "num_completion_tokens")
                  if k in ev}
        record({**base, **fields})


def _failed(res: ClientResult, status: int, raw: bytes, record: Record) -> ClientResult:
    res.reason = "rejected" if status == 429 else "error"
    res.message = _error_message(status, raw)
    res.finished_ns = now_ns()
    record(_client_event("finished", res.request_id, res.worker_id, None, reason=res.reason, status=status,
                         message=res.message, num_completion_tokens=0))
    return res


def _prompt_len(body: dict) -> int | None:
    for key in ("prompt_token_ids", "prompt"):
        v = body.get(key)
        if isinstance(v, list) and v and isinstance(v[0], int):
            return len(v)
    return None


def openai_stream_body(body: dict) -> dict:
    """The body :func:`stream_openai` sends for ``body``: streamed, with the usage block at the end."""
    return {**body, "stream": True, "stream_options": {"include_usage": True}}


async def stream_openai(sess: aiohttp.ClientSession, endpoint: str, body: dict, *, request_id: str,
                        chat: bool = False, record: Record = _noop, tags: dict | None = None,
                        worker_hint: str | None = None, on_text: Callable[[str], None] | None = None,
                        payload: bytes | None = None) -> ClientResult:
    """POST /v1/completions (or chat) with stream=true and read the SSE chunks (``on_text(piece)`` sees
    each piece of text as it arrives).

    The worker id is the server's ``X-Worker-Id`` header (ours), else ``worker_hint``, else the
    endpoint URL. ``payload``: ``json_body(openai_stream_body(body))`` made beforehand, sent as it is."""
    res = ClientResult(request_id, endpoint)
    tags = tags or {}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = openai_stream_body(body)
    sub = _client_event("submitted", request_id, worker_hint or endpoint, None, **{"endpoint": endpoint, "api": "openai",
                                                                "prompt_tokens": _prompt_len(body),
                                                                "max_tokens": body.get("max_tokens"), **tags})
    res.submitted_ns = sub["t_ns"]
    record(sub)
    finish: str | None = None
    try:
        async with _post(sess, f"{endpoint.rstrip('/')}{path}", body, payload) as resp:
            res.status = resp.status
            res.worker_id = resp.headers.get("X-Worker-Id") or worker_hint or endpoint
            if resp.status != 200:
                return _failed(res, resp.status, await resp.read(), record)
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                t = now_ns()
                chunk = json.loads(data)
                if isinstance(chunk.get("error"), dict):
                    res.reason, res.message = "error", str(chunk["error"].get("message"))
                    continue
                if chunk.get("usage"):
                    res.usage_completion_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    piece, is_token = _piece(choice, chat)
                    if on_text is not None and piece:
                        on_text(piece)
                    res.text += piece
                    if is_token:
                        res.tokens += 1
                        if res.first_token_ns is None:
                            res.first_token_ns = t
                        record({"event": "token", "request_id": request_id, "worker_id": res.worker_id,
                                "round": None, "t_ns": t, "observer": "client", "index": res.tokens})
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        res.reason, res.message = "error", f"{type(e).__name__}: {e}"
    if res.reason is None:
        res.reason = {"stop": "stop", "length": "length", None: "error"}.get(finish, "cancelled")
        if finish is None:
            res.message = "the stream ended without a finish_reason"
    res.finished_ns = now_ns()
    count = res.usage_completion_tokens if res.usage_completion_tokens is not None else res.tokens
    record(_client_event("finished", request_id, res.worker_id, None, reason=res.reason, message=res.message,
                         num_completion_tokens=count, openai_finish_reason=finish))
    return res


def _piece(choice: dict, chat: bool) -> tuple[str, bool]:
    """(text, whether this chunk carries an output token).

    Our server sends one chunk per output token (its text maybe "") and then a separate finish chunk
    whose text is only what the detokenizer or the stop strings held back (an incomplete UTF-8
    character, a possible stop-string prefix): text, but no token. So a chunk with a finish_reason
    never counts as a token; the exact count is the stream's final ``usage.completion_tokens``."""
    if choice.get("finish_reason"):
        if chat:
            return (choice.get("delta") or {}).get("content") or "", False
        return choice.get("text") or "", False
    if chat:
        delta = choice.get("delta") or {}
        if "content" not in delta or delta.get("content") is None:
            return "", False
        if "role" in delta and delta.get("content") == "":
            return "", False
        return delta["content"], True
    return choice.get("text") or "", True


# --------------------------------------------------------------------------- labkit client


def run_client(endpoint: str, prompt: str | None = None, max_tokens: int = 32, request_id: str = "demo",
               cancel_after: int | None = None, out: Path | None = None, api: str = "native",
               temperature: float = 0.0, prompt_token_ids: list[int] | None = None, ignore_eos: bool = False,
               timeout_s: float = 600.0, api_key: str | None = None,
               on_text: Callable[[str], None] | None = None) -> dict:
    """One request against a running server; writes a JSONL (header + events) when ``out`` is given;
    ``on_text(piece)`` sees the text as it streams in."""
    if api not in ("native", "openai"):
        raise UserError(f"--api must be native or openai, got {api!r}")
    if cancel_after is not None and api != "native":
        raise UserError("--cancel-after needs --api native (POST /cancel is a native route)")
    if (prompt is None) == (prompt_token_ids is None):
        raise UserError("give a --prompt (or token ids)")
    return asyncio.run(_client_main(endpoint.rstrip("/"), prompt, prompt_token_ids, max_tokens, request_id,
                                    cancel_after, out, api, temperature, ignore_eos, timeout_s, api_key,
                                    on_text))


async def _client_main(endpoint, prompt, token_ids, max_tokens, request_id, cancel_after, out, api, temperature,
                       ignore_eos, timeout_s, api_key=None, on_text=None) -> dict:

    events: list[dict] = []
    async with session(timeout_s, api_key=api_key) as sess:
        health = await fetch_health(sess, endpoint)
        if health is None and api == "native":
            raise UserError(f"no labkit server answers at {endpoint}/health (is `labkit serve` running there?)")
        log = EventLog(out) if out else None
        try:
            if log is not None:
                log.write_header(log_header("client", [health], {"endpoint": endpoint, "api": api,
                                                                 "cancel_after": cancel_after}))

            def record(ev: dict) -> None:
                events.append(ev)
                if log is not None:
                    log.write(ev)

            if api == "native":
                body: dict[str, Any] = {"request_id": request_id, "max_tokens": max_tokens,
                                        "temperature": temperature, "ignore_eos": ignore_eos}
                body["prompt" if prompt is not None else "prompt_token_ids"] = prompt if prompt is not None else token_ids
                res = await stream_native(sess, endpoint, body, record=record, cancel_after=cancel_after,
                                          worker_hint=(health or {}).get("worker_id"), on_text=on_text)
            else:
                model = await fetch_model_name(sess, endpoint)
                body = {"model": model, "prompt": prompt if prompt is not None else token_ids,
                        "max_tokens": max_tokens, "temperature": temperature, "ignore_eos": ignore_eos}
                res = await stream_openai(sess, endpoint, body, request_id=request_id, record=record,
                                          worker_hint=(health or {}).get("worker_id"), on_text=on_text)
        finally:
            if log is not None:
                log.close()
    summary = res.summary()
    summary["kind"] = (health or {}).get("kind")
    summary["model"] = (health or {}).get("model")
    summary["events"] = len(events)
    summary["out"] = str(out) if out else None
    return summary


def log_header(role: str, healths: list[dict | None], extra: dict) -> dict:
    """Header for a log written on the client side: identity as the servers report it."""
    known = [h for h in healths if h]
    kinds = sorted({h.get("kind") for h in known if h.get("kind")})
    env = envelope(kind=kinds[0] if len(kinds) == 1 else "static")
    env["kind"] = kinds[0] if len(kinds) == 1 else None
    if len(kinds) > 1:
        env["kinds"] = kinds
    first = known[0] if known else {}
    env["model"] = first.get("model")
    env["engine"] = first.get("engine")
    env["device"] = None
    env["servers"] = [{k: h.get(k) for k in ("worker_id", "kind", "served_model_name", "max_model_len")} if h else None
                      for h in healths]
    return {**env, "role": role, **extra}
