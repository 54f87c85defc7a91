"""Fixtures of the service tests: one worker factory and one server factory (module scope, as the service
modules share one worker per module). The plain helpers (``serving``, ``settle_after``, request helpers) stay
in ``service_fixtures.py``, imported by name.

``service_worker(mode="in-process", sink=None, **kw)`` starts a worker on the session's tiny model with the
service modules' common settings (``service_fixtures.BASE``; keywords override them); ``mode`` is
``in-process`` (a ``Worker``) or ``engine-process`` (the engine in a child process).
``service_server(worker, **server_kw)`` serves a worker on 127.0.0.1:0 (a ``ServerThread``).
What they made is closed at the end of the module, servers first (closing a server closes its worker);
a test may close one earlier itself (both closes run once)."""
from __future__ import annotations

import os

import pytest
from service_fixtures import start_worker

from labkit.lab_engine import LAB_BUILDER
from serve.core.engine_build import BUILDER_ENV

# every worker these tests start (in this process or an engine process) builds its engine as labkit does
os.environ.setdefault(BUILDER_ENV, LAB_BUILDER)


@pytest.fixture(scope="module")
def service_worker(tiny_model_dir):
    made = []

    def build(mode: str = "in-process", sink=None, **kw):
        worker = start_worker(tiny_model_dir, mode, sink=sink, **kw)
        made.append(worker)
        return worker

    yield build
    for worker in reversed(made):
        worker.close()


@pytest.fixture(scope="module")
def service_server(service_worker):
    from serve.entrypoints.api_server import ServerThread

    made = []

    def build(worker, **server_kw):
        server = ServerThread(worker, "127.0.0.1", 0, **server_kw).start()
        made.append(server)
        return server

    yield build
    for server in reversed(made):
        server.close()
