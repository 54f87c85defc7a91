"""A request's event stream: bounded, filled by the worker's owner thread, read by one consumer.

The consumer reads synchronously (``get``, ``events``, ``wait``) or from an event loop (``aget``);
the owner's pushes say when more than ``limit`` events are unread, which is how the worker notices a
slow consumer.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque


class RequestHandle:
    """A request's event stream: bounded, filled by the owner, read by one consumer (sync or async)."""

    def __init__(self, request_id: str, limit: int, keep_tokens: bool = True):
        self.request_id = request_id
        self.limit = limit
        self.keep_tokens = keep_tokens
        self.rejected = False
        self.prompt_token_ids: list[int] | None = None   # the prompt as the engine got it (set at submit)
        self.result: dict | None = None          # the finished event
        self.max_buffered = 0                    # high-water mark of unread events
        self.done = threading.Event()
        self._buf: deque[dict] = deque()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    # -- owner side ----------------------------------------------------------------
    def _push(self, event: dict) -> bool:
        """Append; False when more than ``limit`` events are now unread (slow consumer)."""
        with self._lock:
            self._buf.append(event)
            n = len(self._buf)
            self.max_buffered = max(self.max_buffered, n)
        return n <= self.limit

    def _finish(self, event: dict, wake: bool = True) -> None:
        with self._lock:
            self._buf.append(event)
            self.max_buffered = max(self.max_buffered, len(self._buf))
            self.result = event
        self.done.set()
        if wake:
            self._wake()

    def _take_waiters(self) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]:
        """Wake the sync readers; return (and forget) the async ones for the caller to set."""
        with self._lock:
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        return waiters

    def _wake(self) -> None:
        wake_all((self,))

    # -- consumer side -----------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.done.is_set()

    @property
    def buffered(self) -> int:
        with self._lock:
            return len(self._buf)

    def get(self, timeout: float | None = None) -> dict | None:
        """The next event, blocking up to ``timeout`` seconds; None on timeout or after the end."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._buf:
                if self.result is not None:
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            return self._buf.popleft()

    def events(self, timeout: float = 60.0):
        """Iterate until the finished event (inclusive); TimeoutError if a gap exceeds ``timeout``."""
        while True:
            ev = self.get(timeout)
            if ev is None:
                if self.result is not None:
                    return
                raise TimeoutError(f"request {self.request_id}: no event within {timeout} s")
            yield ev
            if ev["event"] == "finished":
                return

    def drain(self) -> list[dict]:
        with self._lock:
            out = list(self._buf)
            self._buf.clear()
            return out

    async def aget(self, timeout: float | None = None) -> list[dict]:
        """Every unread event, waiting up to ``timeout`` for the first; [] on timeout or at the end."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._buf or self.result is not None:
                out = list(self._buf)
                self._buf.clear()
                return out
            waiter = asyncio.Event()
            self._waiters.append((loop, waiter))
        try:
            await asyncio.wait_for(waiter.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                if (loop, waiter) in self._waiters:
                    self._waiters.remove((loop, waiter))
        return self.drain()

    def wait(self, timeout: float | None = None) -> dict | None:
        """The finished event, once there is one (None on timeout)."""
        self.done.wait(timeout)
        return self.result


def _set_all(events: list[asyncio.Event]) -> None:
    for ev in events:
        ev.set()


def wake_all(handles) -> None:
    """Wake the readers of many handles with one ``call_soon_threadsafe`` per event loop (not one per
    handle): the owner thread hands a whole step's wake-ups to the HTTP loop in one call."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Event]] = {}
    for h in handles:
        for loop, ev in h._take_waiters():
            by_loop.setdefault(loop, []).append(ev)
    for loop, evs in by_loop.items():
        try:
            loop.call_soon_threadsafe(_set_all, evs)
        except RuntimeError:        # the consumer's loop is closed
            pass
