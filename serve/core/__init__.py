"""The engine's side of the server: :mod:`.worker` (the owner thread that creates and owns the engine),
:mod:`.records` (a request as the owner holds it, token delivery, step records), :mod:`.fair` (admission across
requests), :mod:`.stream` (a request's stream), :mod:`.config` (a worker's options), :mod:`.front` (the one
interface the HTTP front talks to, and the served engine's frozen record) and the engine in a process of its own:
:mod:`.proc_client` (the parent side) and :mod:`.proc_main` (the child)."""
