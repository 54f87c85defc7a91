"""The online service around the engine (handbook 5.3, 5.5.1, 5.6.1, 5.7).

Pieces, each one file:

- :mod:`labkit.service.worker`: the Worker. One thread creates and owns the engine; ``submit()``
  puts a request into a bounded queue, the owner admits it at a step boundary, and every request
  gets its own bounded event stream (submitted, admitted, token i, finished).
- :mod:`labkit.service.engine_process` (``serve --engine-process``): the same Worker with its engine and
  owner thread in a process of their own; :mod:`labkit.service.engine_child` is that process's side,
  :mod:`labkit.service.remote_views` what the front end reads of it.
- :mod:`labkit.service.stream`: that stream (``RequestHandle``), read sync or async.
- :mod:`labkit.service.events`: the event records, the JSONL log they are written to and its header.
- :mod:`labkit.service.protocol`: request validation for the native and the OpenAI-compatible API
  (and the request-id and tag rules).
- :mod:`labkit.service.server`: the HTTP front (aiohttp): ``/generate`` (NDJSON), ``/cancel``,
  ``/health``, ``/metrics``, ``/v1/completions``, ``/v1/chat/completions`` (SSE), ``/v1/models``.
- :mod:`labkit.service.client`: the HTTP client used by ``labkit client`` and ``labkit load``.
- :mod:`labkit.service.metrics`: Prometheus text for ``/metrics``.
- :mod:`labkit.service.profiling`: torch.profiler around owner-thread steps (``load --profile-dir``).

Server stack: aiohttp. It is installed on the GPU image (which has no fastapi/uvicorn/starlette), it
is one dependency for both the server and the client (load replay, ``labkit client``), it streams
with back-pressure (``await response.write`` waits for the socket to drain), and it can cancel a
handler when its client disconnects, which is how a disconnect becomes a cancel at the owner.
"""
