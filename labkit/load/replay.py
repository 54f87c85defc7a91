"""``labkit load``: replay a fixed arrival trace against the engine and record every event.

Targets
    in process (``--model``/default model): a Worker in this process; events ``observer=engine``.
    ``--serve-local``: that Worker behind its HTTP server on 127.0.0.1 (a free port), driven over
    HTTP like a remote server: serve and load in one command, both observers in one log. Client,
    HTTP loop and owner then share one Python process (and its GIL); for the cleanest client-side
    numbers run ``labkit serve`` in its own process and ``load --endpoints``.
    ``--endpoints a,b``: running servers (ours, or any OpenAI-compatible one with ``--api openai``);
    requests go round-robin, or with ``--router least-work`` to the endpoint with the least
    assigned work so far (prompt + max_tokens of the requests already sent to it: an offline,
    reproducible decision, ties to the first endpoint).

Modes
    ``wall``: each request is sent at its planned ``arrival_ms`` after the window opens; one with
    ``after`` (a multi-turn trace) ``think_time_ms`` after that request finished (``load.depend``).
    ``round`` (in process only): request k enters at scheduler round ``arrival_round`` (counted from
    the replay's first round; idle rounds are skipped): a mechanism view, not a performance run.
    ``--max-concurrency N`` (wall mode): at most N requests in flight, vLLM bench serve's semaphore; a
    request due while all N are taken is sent when one finishes.

Warmup
    ``--warmup-requests N`` requests per target, shaped like the trace's classes but with their
    own prefixes, run to completion before the window opens; marked ``warmup`` and left out of
    every number (``labkit report``).

Output
    ``--out X.jsonl``: the event log (header + events). Next to it ``X.json``: the evidence
    (envelope, options, the report summary; judged against ``--checkpoint`` when given). ``--out
    X.json`` works the other way round (events in ``X.jsonl``).
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from engine import RequestError, SamplingParams
from labkit.checks import run_assertion
from labkit.errors import UserError
from labkit.evidence import envelope, write_evidence, write_json
from labkit.lab_engine import LAB_BUILDER
from labkit.load.client import log_header
from serve.observe.events import EventLog, split_out
from serve.core.config import WorkerConfig
from serve.heap import frozen_heap
from labkit.load.depend import has_deps, replay_async, replay_threads, split_deps
from labkit.load.trace import read_trace, warmup_requests

MODES = ("wall", "round")
APIS = ("native", "openai")
ROUTERS = ("round-robin", "least-work")


@dataclass
class LoadOptions:
    trace: Path
    out: Path
    endpoints: list[str] = field(default_factory=list)
    serve_local: bool = False
    mode: str = "wall"
    warmup_requests: int = 2
    api: str = "native"
    router: str = "round-robin"
    worker: WorkerConfig = field(default_factory=WorkerConfig)   # the in-process engine (model, knobs)
    profile_dir: Path | None = None
    openai_model: str | None = None
    timeout_s: float = 600.0
    checkpoint: str | None = None
    show_progress: bool = True
    progress_label: str = "load"
    max_concurrency: int | None = None      # requests in flight at most (vLLM bench serve's); None: no cap


def sampling(r: dict) -> SamplingParams:
    return SamplingParams(temperature=float(r.get("temperature", 0.0)), max_tokens=int(r["max_tokens"]),
                          ignore_eos=bool(r.get("ignore_eos", True)), seed=r.get("seed"))


def tags_of(r: dict) -> dict:
    return {"class": r.get("class", "all"), "trace_index": r.get("index"), "warmup": bool(r.get("warmup", False))}


# --------------------------------------------------------------------------- routing


class Router:
    def __init__(self, endpoints: list[str], policy: str = "round-robin"):
        if policy not in ROUTERS:
            raise UserError(f"--router must be one of {', '.join(ROUTERS)}, got {policy!r}")
        self.endpoints = endpoints
        self.policy = policy
        self.assigned_work = [0] * len(endpoints)
        self.assigned_requests = [0] * len(endpoints)
        self._next = 0

    def pick(self, r: dict) -> int:
        if self.policy == "round-robin":
            i = self._next % len(self.endpoints)
            self._next += 1
        else:
            i = min(range(len(self.endpoints)), key=lambda k: (self.assigned_work[k], k))
        self.assigned_work[i] += int(r.get("prompt_tokens", len(r["prompt_token_ids"]))) + int(r["max_tokens"])
        self.assigned_requests[i] += 1
        return i

    def summary(self) -> dict:
        return {"policy": self.policy, "endpoints": self.endpoints, "assigned_work": self.assigned_work,
                "assigned_requests": self.assigned_requests}


# --------------------------------------------------------------------------- the command


def run_load(opts: LoadOptions) -> dict:
    """Replay the trace; returns the evidence record (also written next to the log)."""
    check_options(opts)
    head, reqs = read_trace(opts.trace)
    if has_deps(reqs):
        if opts.mode == "round":
            raise UserError(f"{opts.trace}: its requests wait on replies (after=, multi-turn); use --mode wall")
        split_deps(reqs)        # a dangling or cyclic after= refused before anything starts
    warm = warmup_requests(reqs, opts.warmup_requests)
    events_path, evidence_path = split_out(opts.out)
    extra = {"mode": opts.mode, "api": opts.api, "trace": str(opts.trace),
             "trace_options": (head or {}).get("options"), "warmup_requests": opts.warmup_requests,
             "load_options": {k: (str(v) if isinstance(v, Path) else v)
                              for k, v in {**asdict(opts), "worker": opts.worker.flat()}.items()}}
    log = EventLog(events_path)
    worker = server = None
    facts: dict[str, Any] = {}
    try:
        if opts.endpoints:
            router = Router(opts.endpoints, opts.router)
            healths, _ = asyncio.run(drive_http(opts, reqs, warm, router, log, header=("load", extra)))
            kind = remote_kind(healths)
            ident: dict[str, Any] = remote_identity(healths)
        else:
            from serve.core.worker import Worker

            worker = Worker(worker_config(opts), sink=log.write, build=LAB_BUILDER).start()
            kind = "profile" if opts.profile_dir else worker.served.kind
            header = worker.header(envelope, role="load", **extra)
            header["kind"] = kind
            if opts.serve_local:
                from serve.entrypoints.api_server import ServerThread

                server = ServerThread(worker).start()
                header["endpoints"] = [server.url]
                log.write_header(header)
                router = Router([server.url], opts.router)
                _, profile = asyncio.run(drive_http(opts, reqs, warm, router, log, worker=worker,
                                                     log_server_events=False))
            else:
                log.write_header(header)
                router = None
                profile = _drive_inprocess(opts, worker, reqs, warm)
            free, total = worker.run_on_owner(lambda e: (e.stats().free_blocks, e.stats().num_blocks))
            facts["engine_config"] = worker.run_on_owner(lambda e: e.describe()["config"])   # what the engine ran with
            facts["worker_config"] = {k: v for k, v in worker.config.flat().items()
                                      if k in ("scheduling_policy", "max_num_batched_tokens", "max_num_seqs",
                                               "max_active", "queue_size", "max_model_len", "worker_id")}
            facts["kv_blocks"] = {"free_at_end": free, "total": total}
            facts["kv_free_at_end_equals_total"] = free == total
            facts["profile"] = profile
            served = worker.served
            ident = {"model": served.model, "device": served.device, "engine": served.describe(), "seed": served.seed}
    finally:
        if server is not None:
            server.close()
        elif worker is not None:
            worker.close()
        log.close()
    from labkit.load.report import summarize

    summary = summarize(events_path)
    facts.update(_facts(summary, reqs, opts, router))
    facts["events"] = str(events_path)
    facts["load_options"] = extra["load_options"]
    if kind is None:
        record = {**envelope(kind="static"), "kind": None, "checkpoint": opts.checkpoint, "facts": facts,
                  "checks": [], "verdict": "REVIEW",
                  "note": "the servers did not report an evidence kind; judge by hand"}
        write_json(evidence_path, record)
        return record
    return write_evidence(evidence_path, checkpoint=opts.checkpoint, kind=kind, facts=facts,
                          device=ident.get("device"), model=ident.get("model"), seed=ident.get("seed"),
                          engine=ident.get("engine"), run_assertions=_sanity(facts))


def _sanity(facts: dict) -> list[dict]:
    """Run assertions every load run gets, checkpoint or not, over the counts the event log gave."""
    out = [run_assertion("len(facts.terminations)", "gt", 0, name="observers recorded",
                         why="the event log holds at least one observer's terminations")]
    for obs in facts["terminations"]:
        out += [
            run_assertion(f"facts.unfinished.{obs}", "eq", 0, name=f"every request finished ({obs})",
                          why="each measured request has a finished event"),
            run_assertion(f"facts.errors.{obs}", "eq", 0, name=f"no engine error ({obs})", why="no request failed"),
        ]
    if "kv_free_at_end_equals_total" in facts:
        out.append(run_assertion("facts.kv_free_at_end_equals_total", "is_true", name="KV blocks all free at the end",
                                 why="no request leaked KV blocks (free blocks counted after the run)"))
    return out


def check_options(opts: LoadOptions) -> None:
    """The load options' refusals, one line each, before anything runs (the rate sweep's too)."""
    if opts.checkpoint is not None:
        _check_claim(opts.checkpoint)
    if opts.mode not in MODES:
        raise UserError(f"--mode must be one of {', '.join(MODES)}, got {opts.mode!r}")
    if opts.api not in APIS:
        raise UserError(f"--api must be one of {', '.join(APIS)}, got {opts.api!r}")
    if opts.router not in ROUTERS:
        raise UserError(f"--router must be one of {', '.join(ROUTERS)}, got {opts.router!r}")
    if opts.endpoints and (opts.worker.engine.model or opts.serve_local):
        raise UserError("--endpoints drives running servers; leave out --model and --serve-local")
    if opts.mode == "round" and (opts.endpoints or opts.serve_local):
        raise UserError("--mode round injects per scheduler round and needs the in-process engine; "
                        "use --mode wall over HTTP")
    if opts.profile_dir and opts.endpoints:
        raise UserError("--profile-dir profiles the in-process engine; it cannot profile a remote server")
    if opts.api == "openai" and not (opts.endpoints or opts.serve_local):
        raise UserError("--api openai talks HTTP: give --endpoints or --serve-local")
    if opts.warmup_requests < 0:
        raise UserError(f"--warmup-requests must be >= 0, got {opts.warmup_requests}")
    if opts.max_concurrency is not None:
        if isinstance(opts.max_concurrency, bool) or not isinstance(opts.max_concurrency, int) \
                or opts.max_concurrency < 1:
            raise UserError(f"--max-concurrency must be a positive integer, got {opts.max_concurrency!r}")
        if opts.mode == "round":
            raise UserError("--max-concurrency holds requests back until one finishes; --mode round injects per "
                            "scheduler round: use --mode wall")
    for ep in opts.endpoints:
        if not ep.startswith(("http://", "https://")):
            raise UserError(f"endpoint {ep!r} must start with http:// or https://")


def _check_claim(checkpoint: str) -> None:
    """``--checkpoint ID`` only with ID's own command and options (the judge checks the command line too):
    refused before anything runs, one line."""
    from labkit.checks import command_mismatch, get_checkpoint
    from labkit.evidence import command_line

    cp = get_checkpoint(checkpoint)
    problem = command_mismatch(cp.command, command_line())
    if problem:
        raise UserError(f"--checkpoint {checkpoint}: {problem}; its command is `{' '.join(cp.command)}`")


def worker_config(opts: LoadOptions) -> WorkerConfig:
    return replace(opts.worker, load_tokenizer=opts.serve_local)


def remote_kind(healths: list[dict | None]) -> str | None:
    kinds = {(h or {}).get("kind") for h in healths}
    return kinds.pop() if len(kinds) == 1 and None not in kinds else None


def remote_identity(healths: list[dict | None]) -> dict:
    """The served model, device and engine as the servers report them (/health completed with /config): the
    first server's model, the device where every server names the same one, and the engine's description
    (``LLMEngine.describe``: its attention backend, graphs, KV cache) where there is exactly one server."""
    devices = {(h or {}).get("device") for h in healths}
    return {"model": (healths[0] or {}).get("model") if healths else None,
            "device": devices.pop() if len(devices) == 1 else None,
            "engine": (healths[0] or {}).get("engine") if len(healths) == 1 else None}


def _facts(summary: dict, reqs: list[dict], opts: LoadOptions, router: "Router | None") -> dict:
    obs = summary["observers"]
    pick = lambda o, *k: _dig(obs.get(o, {}), *k)  # noqa: E731
    facts = {
        "trace_requests": len(reqs),
        "requests": max((o["requests"] for o in obs.values()), default=0),
        "completed": {o: v["completed"] for o, v in obs.items()},
        "rejections": {o: v["rejections"] for o, v in obs.items()},
        "terminations": {o: v["terminations"] for o, v in obs.items()},
        "unfinished": {o: int(v["terminations"].get("unfinished", 0)) for o, v in obs.items()},
        "errors": {o: int(v["terminations"].get("error", 0)) for o, v in obs.items()},
        "output_tokens": {o: v["output_tokens"] for o, v in obs.items()},
        "expected_output_tokens": sum(int(r["max_tokens"]) for r in reqs),
        "ttft_ms": {o: {q: pick(o, "ttft_ms", q) for q in ("p50", "p90", "p99")} for o in obs},
        "itl_ms": {o: {q: pick(o, "itl_ms", q) for q in ("p50", "p90", "p99")} for o in obs},
        "tpot_ms": {o: {q: pick(o, "tpot_ms", q) for q in ("p50", "p90", "p99")} for o in obs},
        "throughput_tok_s": {o: v.get("throughput_tok_s") for o, v in obs.items()},
        "window_s": {o: _dig(v, "window", "seconds") for o, v in obs.items()},
        "mode": opts.mode, "api": opts.api, "warmup_requests": opts.warmup_requests,
        "router": router.summary() if router else None,
        "summary": summary,
    }
    return facts


def _dig(d: Any, *keys):
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


# --------------------------------------------------------------------------- in process


def _submit(worker, r: dict):
    try:
        return worker.submit(r["prompt_token_ids"], sampling(r), request_id=r["request_id"], tags=tags_of(r),
                             stream=False)
    except RequestError as e:
        raise UserError(f"trace request {r['request_id']}: {e}") from None


class Slots:
    """``--max-concurrency`` in process: at most ``n`` requests in flight (vLLM bench serve's semaphore); a
    request that arrives while all are taken is submitted when one finishes (None: no cap)."""

    def __init__(self, n: int | None, timeout_s: float):
        self.sem = threading.BoundedSemaphore(n) if n else None
        self.timeout_s = timeout_s

    def submit(self, worker, r: dict):
        if self.sem is None:
            return _submit(worker, r)
        if not self.sem.acquire(timeout=self.timeout_s):
            raise UserError(f"request {r['request_id']} found no free slot (--max-concurrency) within "
                            f"{self.timeout_s:g} s")
        try:
            h = _submit(worker, r)
        except BaseException:
            self.sem.release()
            raise
        threading.Thread(target=self._release_when_done, args=(h,), daemon=True).start()   # at most n of these
        return h

    def _release_when_done(self, handle) -> None:
        handle.done.wait(self.timeout_s)
        self.sem.release()


def _wait_all(handles: list, timeout_s: float, progress=None) -> None:
    deadline = time.monotonic() + timeout_s
    for h in handles:
        left = deadline - time.monotonic()
        if left <= 0 or h.wait(left) is None:
            raise UserError(f"request {h.request_id} did not finish within {timeout_s:g} s")
        if progress is not None:
            progress()


def _progress(opts: LoadOptions, total: int, label: str):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from labkit.console import err_console

    # the label as a styled column: a markup string column would be drawn by the console, which has markup off
    return Progress(TextColumn(label, style="bold", markup=False), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=err_console, transient=True, disable=not opts.show_progress)


def _drive_inprocess(opts: LoadOptions, worker, reqs: list[dict], warm: list[dict]) -> dict | None:
    if warm:
        _wait_all([_submit(worker, r) for r in warm], opts.timeout_s)
    profiler = _start_profile(opts, worker)
    slots = Slots(opts.max_concurrency, opts.timeout_s)
    with _progress(opts, len(reqs), "load") as bar:
        task = bar.add_task("load", total=len(reqs))
        if opts.mode == "round":
            handles: list = []
            feeder = RoundFeeder(worker, reqs, handles)
            worker.set_feeder(feeder)
            if not feeder.done.wait(opts.timeout_s):
                raise UserError(f"round replay did not submit every request within {opts.timeout_s:g} s")
            if feeder.error is not None:
                raise feeder.error
        elif has_deps(reqs):
            replay_threads(reqs, lambda r: slots.submit(worker, r), opts.timeout_s, on_done=lambda: bar.advance(task))
            handles = []            # every one finished already (a follower waits on its request's handle)
        else:
            handles = []
            t0 = time.monotonic()
            for r in reqs:
                delay = t0 + r["arrival_ms"] / 1000.0 - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                handles.append(slots.submit(worker, r))
        _wait_all(handles, opts.timeout_s, progress=lambda: bar.advance(task))
    return _stop_profile(opts, worker, profiler)


class RoundFeeder:
    """Owner-thread callback: submits the requests due at this round (idle rounds are skipped)."""

    def __init__(self, worker, reqs: list[dict], handles: list):
        import threading

        self.worker = worker
        self.queue = deque(sorted(reqs, key=lambda r: r["arrival_round"]))
        self.handles = handles
        self.start: int | None = None
        self.shift = 0
        self.error: Exception | None = None
        self.done = threading.Event()

    def __call__(self, round_: int) -> None:
        try:
            self._feed(round_)
        except Exception as e:          # never let a bad request kill the owner thread
            self.error = e
            self.queue.clear()
        if not self.queue:
            self.worker.set_feeder(None)
            self.done.set()

    def _feed(self, round_: int) -> None:
        if self.start is None:
            self.start = round_ - self.queue[0]["arrival_round"]
        if self.queue and self.worker.idle() and self.queue[0]["arrival_round"] > round_ - self.start + self.shift:
            self.shift = self.queue[0]["arrival_round"] - (round_ - self.start)
        while self.queue and self.queue[0]["arrival_round"] <= round_ - self.start + self.shift:
            self.handles.append(_submit(self.worker, self.queue.popleft()))


def _start_profile(opts: LoadOptions, worker):
    if not opts.profile_dir:
        return None
    from serve.observe.profiling import StepProfiler

    prof = StepProfiler(opts.profile_dir, worker.served.device)
    prof.prime()
    worker.run_on_owner(lambda engine: prof.start(worker, engine))
    return prof


def _stop_profile(opts: LoadOptions, worker, prof) -> dict | None:
    if prof is None:
        return None
    summary = worker.run_on_owner(lambda engine: prof.stop(worker, engine))
    served = worker.served
    trace = Path(summary["trace"])
    summary["trace_written"] = trace.is_file() and trace.stat().st_size > 0
    assertions = [run_assertion(f"facts.ranges.{name}.count", "gt", 0, name=f"range {name} recorded",
                                why="the profiler saw this range on the owner thread")
                  for name in ("step", "prepare", "forward", "sample")]
    assertions.append(run_assertion("facts.trace_written", "is_true", name="Chrome trace written",
                                    why="a non-empty trace file: open it in chrome://tracing or Perfetto"))
    record = write_evidence(Path(opts.profile_dir) / "profile.json", checkpoint=None, kind="profile",
                            facts={**summary, "trace_file": str(opts.trace), "mode": opts.mode},
                            device=served.device, model=served.model, seed=served.seed,
                            engine=served.describe(), run_assertions=assertions)
    summary["evidence"] = str(Path(opts.profile_dir) / "profile.json")
    summary["verdict"] = record["verdict"]
    return summary


# --------------------------------------------------------------------------- over HTTP


def prepare_payloads(reqs: list[dict], names: list[str | None], body_of,
                     api: str) -> dict[tuple[str, str | None], bytes]:
    """Every measured request's body serialised before the window opens (per served model name the OpenAI body
    names; one for the native API), keyed by (request id, name): sent as they are, so that a burst's requests
    do not wait on each other's JSON."""
    from labkit.load import client

    first = {}
    for k, name in enumerate(names):
        first.setdefault(name, k)
    out = {}
    for r in reqs:
        for name, k in first.items():
            body = body_of(k, r)
            if api != "native":
                body = client.openai_stream_body(body)
            out[(r["request_id"], name)] = client.json_body(body)
    return out


async def drive_http(opts: LoadOptions, reqs: list[dict], warm: list[dict], router: Router, log: EventLog,
                     header: tuple[str, dict] | None = None, worker=None, log_server_events: bool = True):
    from labkit.load import client

    endpoints = router.endpoints
    async with client.session(opts.timeout_s) as sess:
        healths = [await client.fetch_health(sess, ep) for ep in endpoints]
        if opts.api == "native":
            missing = [ep for ep, h in zip(endpoints, healths) if h is None]
            if missing:
                raise UserError(f"no labkit server answers at {missing[0]}/health (use --api openai for other servers)")
        names = [opts.openai_model or (await client.fetch_model_name(sess, ep) if opts.api == "openai" else None)
                 for ep in endpoints]
        if opts.api == "openai" and None in names:
            raise UserError(f"{endpoints[names.index(None)]}/v1/models gave no model id; pass --openai-model")
        hints = [(h or {}).get("worker_id") for h in healths]
        if header is not None:
            log.write_header(log_header(header[0], healths, {**header[1], "endpoints": endpoints,
                                                            "router": router.policy}))

        def body_of(k: int, r: dict) -> dict:
            if opts.api == "native":
                return {"request_id": r["request_id"], "prompt_token_ids": r["prompt_token_ids"],
                        "max_tokens": r["max_tokens"], "temperature": r.get("temperature", 0.0),
                        "ignore_eos": r.get("ignore_eos", True), "tags": tags_of(r), "detokenize": False}
            return {"model": names[k], "prompt": r["prompt_token_ids"], "max_tokens": r["max_tokens"],
                    "temperature": r.get("temperature", 0.0), "ignore_eos": r.get("ignore_eos", True)}

        prepared: dict[tuple[str, str | None], bytes] = {}

        async def send(k: int, r: dict, routed: dict | None = None):
            tags = {**tags_of(r), **(routed or {})}
            body = body_of(k, r)
            payload = prepared.pop((r["request_id"], names[k]), None)
            if opts.api == "native":
                return await client.stream_native(sess, endpoints[k], body, record=log.write,
                                                  log_server_events=log_server_events, tags=tags,
                                                  worker_hint=hints[k], payload=payload)
            return await client.stream_openai(sess, endpoints[k], body, request_id=r["request_id"], record=log.write,
                                              tags=tags, worker_hint=hints[k], payload=payload)

        if warm:
            jobs = []
            for k in range(len(endpoints)):
                for r in warm:
                    jobs.append(send(k, {**r, "request_id": f"{r['request_id']}-e{k}"}))
            await asyncio.gather(*jobs)
        prepared.update(prepare_payloads(reqs, names, body_of, opts.api))
        prof = _start_profile(opts, worker) if worker is not None else None
        loop = asyncio.get_running_loop()
        slots = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None

        async def measured(k: int, r: dict, routed: dict | None = None):
            if slots is None:
                return await send(k, r, routed)
            async with slots:               # vLLM bench serve's semaphore: a request is sent when a slot is free
                return await send(k, r, routed)

        # the heap made so far (torch, the trace) frozen out of full collections, one of which (over 100 ms on CPU)
        # would hold back a burst's requests: a collection in the window walks only what the window makes
        with _progress(opts, len(reqs), opts.progress_label) as bar, frozen_heap():
            task = bar.add_task("load", total=len(reqs))
            if has_deps(reqs):
                async def routed(r: dict):
                    k = router.pick(r)
                    return await measured(k, r, {"endpoint": endpoints[k], "router": router.policy})

                await replay_async(reqs, routed, on_done=lambda: bar.advance(task))
            else:
                t0 = loop.time()
                tasks = []
                for r in reqs:
                    delay = t0 + r["arrival_ms"] / 1000.0 - loop.time()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    k = router.pick(r)
                    t = asyncio.create_task(measured(k, r, {"endpoint": endpoints[k], "router": router.policy}))
                    t.add_done_callback(lambda _: bar.advance(task))
                    tasks.append(t)
                    # the request just made goes on its way before the next one due is made: a burst's requests
                    # leave one by one as they are ready, not all after the last one is made
                    await asyncio.sleep(0)
                await asyncio.gather(*tasks)
        profile = None
        if prof is not None:
            profile = await loop.run_in_executor(None, _stop_profile, opts, worker, prof)
        return healths, profile
