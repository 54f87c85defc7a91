"""Ending a process that has closed in order (``labkit serve``, the engine process) without the interpreter's
teardown of its modules: importing torch and xgrammar makes that teardown 0.7-1.6 s on an idle 2-core machine
and 4 s under load, all of it after the server had closed (a SIGTERM to the server must end it within 2 s)."""
from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

from serve.observe.logsafe import release_native_stderr


def end_without_teardown(code: int) -> NoReturn:
    """End the process now: other threads joined (bounded), the atexit handlers run (logging flushed, executor
    threads and multiprocessing children joined, weakref finalizers), stdout and stderr flushed, then
    ``os._exit``. Only the module teardown a normal exit does after those is skipped."""
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join(5.0)
    atexit._run_exitfuncs()          # what a normal exit runs before the teardown (CPython's own hook)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    release_native_stderr()          # what native code wrote last, still in the pipe, reaches stderr
    os._exit(code)
