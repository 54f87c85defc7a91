"""The HTTP front (aiohttp): :mod:`.api_server` (the app, its route table, the server and its thread),
:mod:`.http` (access control and middleware), :mod:`.connections` (timeouts, the cap, the quiet log),
:mod:`.serving` (the submission path both APIs share), :mod:`.serving_native` and :mod:`.serving_openai` (the
routes), :mod:`.detokenize` (incremental text, stop strings, log-prob formatting) and :mod:`.launch` (bind,
start, serve until a signal)."""
