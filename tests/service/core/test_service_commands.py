"""The command pipe of ``serve --engine-process``: the parent's sender thread sends what was queued while it wrote
as one Commands message, in order; a failed pipe or a Close refuses later commands; the engine process serves a
Commands message command by command and stops at its Close."""
from __future__ import annotations

import threading

import pytest
from testkit import wait_for

from serve.core import proc_main
from serve.core.messages import Cancel, Close, Commands
from serve.core.proc_client import CommandSender


class Conn:
    """A pipe end that records what is sent; the first send waits for ``release`` (so commands queue up)."""

    def __init__(self, fail: bool = False):
        self.sent: list = []
        self.release = threading.Event()
        self.entered = threading.Event()
        self.fail = fail

    def send(self, msg) -> None:
        if not self.sent:
            self.entered.set()
            self.release.wait(10)
        if self.fail:
            raise BrokenPipeError("gone")
        self.sent.append(msg)


def cancel(i: int) -> Cancel:
    return Cancel(f"r{i}", "client", "cancelled")


def test_what_queues_while_the_sender_writes_goes_as_one_message_in_order():
    conn = Conn()
    sender = CommandSender(conn, "test-sender").start()
    sender.send(cancel(0))
    assert conn.entered.wait(10)                  # the first command is being written on its own
    for i in range(1, 6):
        sender.send(cancel(i))
    conn.release.set()
    wait_for(lambda: len(conn.sent) == 2, timeout=10)
    assert conn.sent[0] == cancel(0)
    assert isinstance(conn.sent[1], Commands) and conn.sent[1].messages == [cancel(i) for i in range(1, 6)]
    sender.send(Close(1.0))
    sender.join(10)
    assert conn.sent[-1] == Close(1.0)
    with pytest.raises(OSError):                  # nothing after Close
        sender.send(cancel(9))


def test_a_failed_pipe_refuses_later_commands():
    conn = Conn(fail=True)
    sender = CommandSender(conn, "test-sender").start()
    sender.send(cancel(0))
    conn.release.set()
    sender.join(10)
    with pytest.raises(OSError, match="failed"):
        sender.send(cancel(1))


def test_the_engine_process_serves_a_commands_message_in_order_up_to_close():
    class Worker:
        def __init__(self):
            self.cancelled = []

        def cancel(self, rid, cause, reason, message):
            self.cancelled.append(rid)

    class Commands_:
        def __init__(self, messages):
            self.messages = messages

        def recv(self):
            return self.messages.pop(0)

    worker = Worker()
    pipe = Commands_([cancel(0), Commands([cancel(1), cancel(2), Close(3.0), cancel(3)])])
    assert proc_main._serve_commands(worker, None, pipe) == 3.0
    assert worker.cancelled == ["r0", "r1", "r2"]
