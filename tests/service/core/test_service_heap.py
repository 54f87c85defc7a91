"""The serving processes' startup heap is frozen out of full garbage collections (serve/heap.py): the front end
of ``labkit serve`` before it serves (given back when it stops), the engine process before it reports ready."""
from __future__ import annotations

import gc

from service_fixtures import frozen_objects, worker_config

from serve.core.proc_client import RemoteWorker
from serve.entrypoints import launch


def test_labkit_serve_serves_on_a_frozen_heap_and_thaws_it_after(tiny_model_dir, monkeypatch):
    seen = []

    async def serve(worker, sock, **kw):
        seen.append(gc.get_freeze_count())

    monkeypatch.setattr(launch, "serve_until_signal", serve)
    assert gc.get_freeze_count() == 0
    launch.run_serve(worker_config(tiny_model_dir, worker_id="heap"), port=0)
    assert len(seen) == 1 and seen[0] > 0
    assert gc.get_freeze_count() == 0


def test_the_engine_process_steps_on_a_frozen_heap(tiny_model_dir):
    with RemoteWorker(worker_config(tiny_model_dir, worker_id="heap-proc")).start() as w:
        assert w.run_on_owner(frozen_objects) > 0
    assert gc.get_freeze_count() == 0                # the parent's own heap is not touched
