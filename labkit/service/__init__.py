"""The online service around the engine (handbook 5.3, 5.5.1, 5.6.1, 5.7).

Pieces, each one file, cut along vLLM's seams:

- :mod:`labkit.service.worker`: the Worker. One thread creates and owns the engine; ``submit()``
  puts a request into a bounded queue, the owner admits it at a step boundary, and every request
  gets its own bounded event stream (submitted, admitted, token i, finished).
- :mod:`labkit.service.engine_process` (``serve --engine-process``): the same Worker with its engine and
  owner thread in a process of their own; :mod:`labkit.service.engine_child` is that process's side.
- :mod:`labkit.service.front`: the one interface the server talks to, in process or not (``WorkerFront``:
  encoding, the submission checks, ids, gauges) and the frozen record of the served engine (``ServedEngine``)
  published once at start; the server never reads the engine.
- :mod:`labkit.service.config`: ``WorkerConfig``: the engine's own ``engine.EngineArgs`` (each option declared once,
  in ``engine/args.py``) and the worker's options.
- :mod:`labkit.service.stream`: a request's stream (``RequestHandle``), read sync or async.
- :mod:`labkit.service.events`: the event records, the JSONL log they are written to and its header.
- :mod:`labkit.service.protocol`: request validation for the native and the OpenAI-compatible API
  (and the request-id and tag rules); pure, no engine.
- the HTTP front (aiohttp): :mod:`labkit.service.api_server` (the app, its route table, the server and its
  thread), :mod:`labkit.service.http` (access control and middleware), :mod:`labkit.service.serving` (the
  submission path both APIs share), :mod:`labkit.service.serving_native` (``/generate``, ``/cancel``,
  ``/health``, ``/config``, ``/metrics``, ``/v1/models``), :mod:`labkit.service.serving_openai`
  (``/v1/completions``, ``/v1/chat/completions``: a response object per request, a chat and a completion
  format), :mod:`labkit.service.detokenize` (incremental text, stop strings, log-prob formatting).
- :mod:`labkit.service.launch`: ``labkit serve`` (bind, start, fit the context, serve until a signal), the
  serve defaults, the stats line.
- :mod:`labkit.service.connections`: connection timeouts, the cap and the quiet log.
- :mod:`labkit.service.client`: the HTTP client used by ``labkit client`` and ``labkit load``.
- :mod:`labkit.service.metrics`: Prometheus text for ``/metrics``.
- :mod:`labkit.service.profiling`: torch.profiler around owner-thread steps (``load --profile-dir``).

Server stack: aiohttp. It is installed on the GPU image (which has no fastapi/uvicorn/starlette), it
is one dependency for both the server and the client (load replay, ``labkit client``), it streams
with back-pressure (``await response.write`` waits for the socket to drain), and it can cancel a
handler when its client disconnects, which is how a disconnect becomes a cancel at the owner.
"""
