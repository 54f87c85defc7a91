"""Middleware.read_json reads a body that has already arrived in the handler's own turn of the event loop (no task
of its own, no extra turn: in a burst of submissions every extra turn waits on every other request's work), and a
body that does not arrive in time is still a 408."""
from __future__ import annotations

import asyncio

import pytest

from serve.entrypoints.http import Middleware
from serve.protocol.wire import ApiError


class Request(dict):
    protocol = None

    def __init__(self, raw: bytes, delay: float = 0.0):
        super().__init__()
        self.raw, self.delay = raw, delay

    async def read(self) -> bytes:
        if self.delay:
            await asyncio.sleep(self.delay)
        return self.raw


def test_a_body_already_here_is_read_without_a_turn_of_the_loop():
    mw = Middleware(access=None, max_body_bytes=1 << 20, timeout_body=5.0)

    async def main():
        turned = []
        asyncio.get_running_loop().call_soon(turned.append, True)
        body = await mw.read_json(Request(b'{"prompt_token_ids":[1,2,3]}'))
        return body, list(turned)           # (the callback runs once main has returned)

    body, turned = asyncio.run(main())
    assert body == {"prompt_token_ids": [1, 2, 3]}
    assert turned == []


def test_a_body_that_does_not_arrive_in_time_is_a_408():
    mw = Middleware(access=None, max_body_bytes=1 << 20, timeout_body=0.05)
    with pytest.raises(ApiError) as e:
        asyncio.run(mw.read_json(Request(b"{}", delay=5.0)))
    assert e.value.status == 408 and e.value.code == "request_timeout"
