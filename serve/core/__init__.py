"""The engine's side of the server: :mod:`.worker` (the owner thread that creates and owns the engine),
:mod:`.records` (a request as the owner holds it, a step's tokens and log record), :mod:`.messages` (typed
records: the owner's outputs, the engine process's commands), :mod:`.output` (the one output processor: outputs
to streams, metrics and log lines, for both worker kinds), :mod:`.fair` (admission across
requests), :mod:`.stream` (a request's stream), :mod:`.config` (a worker's options), :mod:`.front` (the one
interface the HTTP front talks to, and the served engine's frozen record) and the engine in a process of its own:
:mod:`.proc_client` (the parent side) and :mod:`.proc_main` (the child)."""
