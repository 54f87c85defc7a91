"""The OpenAI-compatible and native HTTP server over the engine (handbook 5.3, 5.5.1, 5.6.1, 5.7).

A package beside :mod:`engine`: it imports the engine and nothing of the lab. ``labkit serve`` is a thin shell
over :func:`serve.entrypoints.launch.run_serve`; the lab hands in what only it knows (how a model name becomes an
engine, the evidence header of a log, where logs go). Cut by role, along vLLM's seams:

- :mod:`serve.protocol`: what a request may say. The native and OpenAI request bodies, vLLM's extra fields,
  sampling and structured-output fields, chat rendering and the answer's readers (tool calls, reasoning), the
  error shape (``ApiError``) and strict JSON. Pure: no engine, no I/O.
- :mod:`serve.core`: the engine's side. ``Worker`` (one thread creates and owns the engine; requests queue and
  are admitted at step boundaries), the owner's records and typed outputs, the one output processor both worker
  kinds feed (streams, metrics, log lines), fair admission, a request's stream, the worker's
  configuration, ``WorkerFront`` and ``ServedEngine`` (the one interface the HTTP front talks to, whether the
  engine runs in this process or its own) and the engine process (``proc_client`` the parent side,
  ``proc_main`` the child).
- :mod:`serve.entrypoints`: the HTTP front (aiohttp): the app and its routes, middleware and access, the
  submission path both APIs share, the native and OpenAI routes, detokenizing, connections, launch.
- :mod:`serve.observe`: the event records and their JSONL log, Prometheus ``/metrics``, the profiler, log escaping.
- :mod:`serve.process_exit`: a process that has closed in order ends without the interpreter's module teardown.

Server stack: aiohttp. It is installed on the GPU image (which has no fastapi/uvicorn/starlette), it streams
with back-pressure (``await response.write`` waits for the socket to drain), and it can cancel a handler when
its client disconnects, which is how a disconnect becomes a cancel at the owner.
"""
