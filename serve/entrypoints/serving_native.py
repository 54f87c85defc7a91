"""The native routes: ``POST /generate`` (an NDJSON event stream, or with ``"stream": false`` one JSON
object), ``POST /cancel``, ``GET /health``, ``GET /config``, ``GET /metrics`` and the model list
``GET /v1/models`` (``/v1/models/{id}``).

``/health`` says whether the server is up, what it serves (the served model name, kind, device,
max_model_len) and its load, nothing that names a path; the model path and the engine and worker
configuration are on ``GET /config``, which needs the API key (without one: only from this machine).
"""
from __future__ import annotations

import hmac
import os
import time

from aiohttp import web

from serve.protocol import requests as protocol
from serve.entrypoints.connections import ConnectionLimits
from serve.entrypoints.detokenize import IncrementalText
from serve.entrypoints.http import ClientGone, is_loopback, json_bytes
from serve.protocol.wire import ApiError
from serve.entrypoints.serving import Serving
from serve.core.stream import RequestHandle

HEALTH_FIELDS = ("worker_id", "round", "queue_depth", "active", "engine_waiting", "engine_running",
                 "kv_blocks_total", "kv_blocks_free", "kv_blocks_used")


class NativeRoutes:
    """The routes of the native API and the server's own (health, config, metrics, models)."""

    def __init__(self, serving: Serving, connections: ConnectionLimits):
        self.serving = serving
        self.connections = connections
        self.created = int(time.time())

    async def generate(self, request: web.Request) -> web.StreamResponse:
        sv = self.serving
        req = await sv.parse(request, protocol.parse_native)
        handle = await sv.submit(req)
        text = IncrementalText(sv.worker.tokenizer if req.detokenize else None)
        if not req.stream:
            return await self._collect(handle, request, text)
        resp = web.StreamResponse(headers=sv.headers(handle, **{"Content-Type": "application/x-ndjson",
                                                                "Cache-Control": "no-cache"}))
        sv.http.cors(request, resp)
        try:
            await resp.prepare(request)
            async for batch in sv.batches(handle, request):
                lines = []
                for ev in batch:
                    if ev["event"] == "token" and req.detokenize:
                        ev = {**ev, "text": text.push(ev["token_id"])}
                    lines.append(json_bytes(ev))
                lines.append(b"")
                await resp.write(b"\n".join(lines))      # one write per wake-up, not one per event
            await resp.write_eof()
        except (ClientGone, ConnectionError):
            pass                          # the finally below turns it into a cancel at the owner
        finally:
            sv.abandon(handle)
        return resp

    async def _collect(self, handle: RequestHandle, request: web.Request, text: IncrementalText) -> web.Response:
        events = []
        try:
            async for ev in self.serving.events(handle, request):
                if ev["event"] == "token":
                    text.push(ev["token_id"])
                events.append(ev)
        finally:
            self.serving.abandon(handle)
        body = {"request_id": handle.request_id, "token_ids": text.ids, "text": text.text(),
                "finished": handle.result or {}, "events": events}
        return web.Response(body=json_bytes(body), content_type="application/json",
                            headers={"X-Request-Id": handle.request_id, "X-Worker-Id": self.serving.worker.worker_id})

    async def cancel(self, request: web.Request) -> web.Response:
        sv = self.serving
        rid, token = protocol.parse_cancel(await sv.http.read_json(request))
        if token is None:
            raise ApiError(400, "cancel_token is required: send the X-Cancel-Token of the request's answer",
                           "missing_cancel_token", "cancel_token")
        known = sv.cancel_token(rid)
        if known is None or not hmac.compare_digest(known.encode(), token.encode()) \
                or not sv.cancel(rid):
            raise ApiError(404, f"no request {rid!r} in flight that this cancel token controls (unknown, finished, "
                                "or another client's)", "request_not_found", "request_id")
        return web.json_response({"request_id": rid, "cancelled": True})

    async def health(self, request: web.Request) -> web.Response:
        """Up or not, what is served and the load: nothing that names a path or the configuration."""
        sv = self.serving
        snap = sv.worker.snapshot()
        body = {"status": snap["state"], "state": snap["state"], **{k: snap[k] for k in HEALTH_FIELDS if k in snap},
                "kind": sv.served.kind, "device": sv.served.device,
                "served_model_name": sv.limits.served_model_name, "max_model_len": sv.limits.max_model_len}
        if snap["state"] != "ok":
            body["reason"] = _redact(snap.get("reason") or "", sv.served.model.get("path"))
        return web.json_response(body, status=200 if snap["state"] == "ok" else 503)

    async def config(self, request: web.Request) -> web.Response:
        """The model identity (with its path), engine and worker configuration: with the API key, or from this
        machine when the server has none."""
        sv = self.serving
        if sv.http.access.api_key is None and not is_loopback(request):
            raise ApiError(403, "/config is only served to this machine unless the server has an --api-key",
                           "forbidden")
        served = sv.served
        body = {"served_model_name": sv.limits.served_model_name, "max_model_len": sv.limits.max_model_len,
                "kind": served.kind, "device": served.device, "model": served.model, "engine": served.describe(),
                "worker": sv.worker.config.flat(), "max_body_bytes": sv.limits.max_body_bytes,
                "connections": vars(self.connections)}
        return web.Response(body=json_bytes(body), content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        worker = self.serving.worker
        body, content_type = worker.stats.render(worker.gauges(), request.headers.get("Accept"))
        return web.Response(body=body, headers={"Content-Type": content_type})

    def _model_card(self) -> dict:
        name = self.serving.limits.served_model_name
        return {"id": name, "object": "model", "created": self.created, "owned_by": "nano-lab", "root": name,
                "parent": None, "max_model_len": self.serving.limits.max_model_len}

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [self._model_card()]})

    async def model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}``: the served model, or a 404 error object."""
        model_id = request.match_info["model_id"]
        name = self.serving.limits.served_model_name
        if model_id == "" or not self.serving.limits.serves(model_id):
            raise ApiError(404, f"the model {protocol.show(model_id)} does not exist; this server serves "
                                f"{name!r}", "model_not_found", "model")
        return web.json_response(self._model_card())


def _redact(text: str, model_path: str | None) -> str:
    """``text`` without the model's path (an unhealthy worker's reason may quote an engine message)."""
    text = text.replace(model_path, "<model>") if model_path else text
    home = os.path.expanduser("~")
    return text.replace(home, "~") if home and home != "/" else text
