"""vLLM's utility routes: ``POST /tokenize``, ``POST /detokenize`` and ``GET /version``.

``/tokenize`` encodes exactly as a generation request's prompt is encoded (the same
:meth:`serve.core.front.WorkerFront.encode`: the chat template, special tokens in message content kept as text,
the prompt size limit), so its ``count`` is the prompt_tokens a completion of the same prompt reports.
"""
from __future__ import annotations

import asyncio
from importlib import metadata

from aiohttp import web

from engine import RequestError
from serve.protocol import tokens as protocol
from serve.protocol.wire import ApiError

DISTRIBUTION = "nano-lab"


def version() -> str:
    """The installed distribution's version (``0+unknown`` when it is run from a source tree not installed)."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "0+unknown"


class TokenRoutes:
    def __init__(self, serving):
        self.serving = serving

    def _tokenizer(self):
        tok = self.serving.worker.tokenizer
        if tok is None:
            raise ApiError(400, "this worker was started without a tokenizer", "no_tokenizer")
        return tok

    async def tokenize(self, request: web.Request) -> web.Response:
        sv = self.serving
        req = protocol.parse_tokenize(await sv.http.read_json(request), sv.limits)
        tok = self._tokenizer()
        loop = asyncio.get_running_loop()
        try:
            ids = await loop.run_in_executor(None, sv.worker.encode, req.prompt, req.options)
        except RequestError as e:
            raise ApiError(400, str(e), e.code, req.param) from None
        strs = tok.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return web.json_response({"count": len(ids), "max_model_len": sv.limits.max_model_len, "tokens": ids,
                                  "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        sv = self.serving
        ids = protocol.parse_detokenize(await sv.http.read_json(request), sv.limits, sv.served.vocab_size)
        text = self._tokenizer().decode(ids)
        return web.json_response({"prompt": text})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": version()})
