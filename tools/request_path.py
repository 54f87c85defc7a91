"""One chat request's way from the HTTP route into the engine's scheduler, counted (a figure for the house's shape).

Serves the tiny model in this process (an in-process worker behind the aiohttp server), sends one warm-up chat
request, then traces a second one with a profiler on every thread, from the moment the route handler is entered
to ``Scheduler.add`` (the request queued for the next step). In that window it counts:

- functions: the distinct project functions (engine/, serve/, labkit/) that ran;
- hops: calls from a function of one project file into a function of another;
- representations: the distinct project classes constructed (an ``__init__`` or a dataclass's, or a
  ``__new__`` of a NamedTuple) while the request was on its way: the forms the request takes.

    python tools/request_path.py [--model DIR] [--json OUT] [--list]

Figures depend on the code, not the machine: run it on two commits to compare their request paths.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
ROOTS = tuple(str(REPO / d) + "/" for d in ("engine", "serve", "labkit"))


def _project(filename: str) -> str | None:
    return filename[len(str(REPO)) + 1:] if filename.startswith(ROOTS) else None


class Tracer:
    """Records (thread, kind, file, function, class constructed) for project frames while armed."""

    def __init__(self):
        self.events: list[tuple] = []
        self.lock = threading.Lock()
        self.armed = False

    def __call__(self, frame, event, arg):
        if event != "call" or not self.armed:
            return
        code = frame.f_code
        name = code.co_name
        cls = None
        if name in ("__init__", "__new__", "__post_init__"):
            obj = frame.f_locals.get("self", frame.f_locals.get("cls"))
            klass = obj if isinstance(obj, type) else type(obj) if obj is not None else None
            if klass is not None and klass.__module__.split(".")[0] in ("engine", "serve", "labkit"):
                cls = f"{klass.__module__}.{klass.__qualname__}"
        path = _project(code.co_filename)
        if path is None and cls is None:
            return
        caller = frame.f_back
        caller_path = _project(caller.f_code.co_filename) if caller is not None else None
        with self.lock:
            self.events.append((threading.get_ident(), path or "<generated>", code.co_qualname, cls, caller_path))


def measure(model: str) -> dict:
    from serve.core.worker import Worker, WorkerConfig
    from serve.entrypoints.api_server import ServerThread

    tracer = Tracer()
    threading.setprofile(tracer)          # before the server's and the worker's threads start (3.11 has no
    sys.setprofile(tracer)                # way to set it on a running thread); armed only for the traced request
    config = WorkerConfig(model=model, device="cpu", max_model_len=512, max_num_batched_tokens=256, max_num_seqs=4)
    srv = ServerThread(Worker(config).start(), "127.0.0.1", 0).start()

    def chat() -> dict:
        models = json.load(urllib.request.urlopen(f"{srv.url}/v1/models", timeout=60))
        payload = {"model": models["data"][0]["id"], "messages": [{"role": "user", "content": "hello there"}],
                   "max_tokens": 2, "temperature": 0}
        req = urllib.request.Request(f"{srv.url}/v1/chat/completions", json.dumps(payload).encode(),
                                     {"Content-Type": "application/json"})
        return json.load(urllib.request.urlopen(req, timeout=120))

    try:
        chat()                                           # warm: lazy imports, templates, first compiles
        tracer.armed = True
        chat()
        tracer.armed = False
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        srv.close()
    return _window(tracer.events)


def _window(events: list[tuple]) -> dict:
    start = next((i for i, e in enumerate(events) if e[1].startswith("serve/entrypoints/") and "chat" in e[2]),
                 None)
    if start is None:
        raise SystemExit("the chat route was not seen (no profile on the server's thread?)")
    added = next((i for i in range(start, len(events)) if events[i][2] in ("Scheduler.add",)), None)
    end = added
    if added is None:
        raise SystemExit("the request never reached Scheduler.add in the trace")
    window = events[start:end + 1]
    functions = sorted({f"{e[1]}:{e[2]}" for e in window if e[1] != "<generated>"})
    hops = sum(1 for e in window if e[4] is not None and e[1] != "<generated>" and e[4] != e[1])
    classes = sorted({e[3] for e in window if e[3]})
    files = sorted({e[1] for e in window if e[1] != "<generated>"})
    return {"functions": len(functions), "files": len(files), "hops": hops, "representations": len(classes),
            "classes": classes, "function_list": functions}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="a model directory (default: the tiny synthetic model, made in a temp dir)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--list", action="store_true", help="print every function and class counted")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from labkit.assets.synth import synth_model
        model = str(synth_model("tiny", Path(tempfile.mkdtemp()) / "tiny", seed=0))
    fig = measure(model)
    print(f"route -> scheduler: {fig['functions']} functions in {fig['files']} files, {fig['hops']} calls across files, "
          f"{fig['representations']} classes constructed")
    if args.list:
        print("\n".join(fig["function_list"]))
        print("classes:\n  " + "\n  ".join(fig["classes"]))
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=1))


if __name__ == "__main__":
    main()
