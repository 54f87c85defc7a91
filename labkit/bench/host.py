"""The served path's host time per token, measured on this machine.

``python -m labkit.bench.host --model DIR [--api native|openai] [--streams 256] ...`` runs a real Worker
(real scheduler, block manager, postprocess, event log) and the real aiohttp Service in this process,
as ``labkit serve`` does, and drives them over loopback from a client in another process (its own GIL):
``streams`` concurrent streamed requests of ``max_tokens`` tokens each.

With ``instant`` (the default) the engine's step makes its ids at once instead of running the model
(schedule and postprocess stay the engine's own): on a CPU the tiny model's forward of 256 rows takes
~2 s and would hide every host cost; without it the run is the real engine. Either way it reports, per generated token, the CPU time
of the owner thread (the engine's) and of the front-end thread (the HTTP event loop), read from each
thread's own CPU clock, and from the server's step records (wide steps only): the step time, the gap
between steps and the owner's time in that gap by part (deliver, wakes, publish, boundary, other).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from labkit.bench.serve import GAP_PARTS
from labkit.bench.spans import percentiles
from labkit.lab_engine import LAB_BUILDER

WIDE_SHARE = 200 / 256           # a wide step carries at least this share of the streams (200 of 256)


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds a thread of this process has used so far (its own clock; Linux, macOS)."""
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def instant_forward(engine) -> None:
    """Make the engine's step produce its ids at once (varied ordinary text tokens, so that the front end's
    detokenizer does real work) instead of running the model; the step is otherwise the engine's own, through
    its public API: schedule() (hooks included), then postprocess() with those ids."""
    from engine.llm_engine import StepOutput

    def step() -> StepOutput:
        t0 = time.perf_counter()
        seqs, is_prefill = engine.schedule()
        batch = [(s.seq_id, s.num_scheduled_tokens) for s in seqs]
        ids = [1000 + (s.seq_id * 7919 + s.num_tokens * 31) % 20000 for s in seqs]
        outcome = engine.postprocess(seqs, ids, is_prefill)
        return StepOutput(engine.num_steps, is_prefill, seqs, outcome, sum(n for _, n in batch),
                          time.perf_counter() - t0, batch)

    engine.step = step


def _client_main(url: str, api: str, streams: int, max_tokens: int, prompt_tokens: int) -> None:
    """The load: ``streams`` streamed requests at once; prints one JSON line (tokens read, seconds)."""
    import aiohttp

    async def one(session: aiohttp.ClientSession, i: int, model: str | None) -> int:
        ids = [100 + (i * 13 + k) % 5000 for k in range(prompt_tokens)]
        body = {"max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        if api == "native":
            body |= {"prompt_token_ids": ids}
            path, marks = "/generate", (b'"event":"token"',)
        else:
            body |= {"model": model, "prompt": ids, "temperature": 0}
            path, marks = "/v1/completions", (b'"text_completion"', b'"finish_reason":null')
        n = 0
        async with session.post(url + path, json=body) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                n += all(m in line for m in marks)
        return n

    async def main() -> dict:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=1800)) as session:
            model = None
            if api != "native":
                async with session.get(url + "/v1/models") as r:
                    model = (await r.json())["data"][0]["id"]
            t0 = time.perf_counter()
            counts = await asyncio.gather(*(one(session, i, model) for i in range(streams)))
            return {"tokens": sum(counts), "seconds": time.perf_counter() - t0, "min_tokens": min(counts)}

    print(json.dumps(asyncio.run(main())), flush=True)


def run_host_bench(model_dir: str, api: str = "native", streams: int = 256, max_tokens: int = 64,
                   prompt_tokens: int = 16, instant: bool = True, log_dir: Path | None = None,
                   switch_interval: float | None = None) -> dict:
    """One measured run; returns its facts (see the module doc)."""
    import tempfile

    from serve.observe.events import EventLog
    from serve.entrypoints.api_server import ServerThread
    from serve.core.config import WorkerConfig
    from serve.core.worker import Worker

    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="labkit-host-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"host-{api}.jsonl"
    model_len = prompt_tokens + max_tokens + 8
    blocks = streams * ((model_len + 255) // 256 + 1) + 8
    cfg = WorkerConfig(model=model_dir, device="cpu", attention_backend="torch", max_num_seqs=streams, max_active=streams,
                       queue_size=2 * streams, max_num_batched_tokens=max(512, streams * prompt_tokens),
                       max_model_len=model_len, num_kvcache_blocks=blocks, worker_id=f"host-{api}")
    old_interval = sys.getswitchinterval()
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)
    sink = EventLog(log_path)
    worker = Worker(cfg, sink=sink, build=LAB_BUILDER).start()
    try:
        if instant:
            worker.run_on_owner(instant_forward)
        server = ServerThread(worker, "127.0.0.1", 0).start()
        try:
            owner, front = worker._thread, server._thread
            cpu0 = (thread_cpu_s(owner), thread_cpu_s(front))
            proc_cpu0 = time.process_time()
            t0 = time.perf_counter()
            worker.pause()            # every stream queued first: each step then carries all of them
            client = subprocess.Popen([sys.executable, "-m", "labkit.bench.host", "--client", server.url,
                                       "--api", api, "--streams", str(streams), "--max-tokens", str(max_tokens),
                                       "--prompt-tokens", str(prompt_tokens)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
            deadline = time.monotonic() + 120
            while len(worker.pending_ids()) < streams and client.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            worker.resume()
            stdout, stderr = client.communicate(timeout=1800)
            wall = time.perf_counter() - t0
            cpu1 = (thread_cpu_s(owner), thread_cpu_s(front))
            proc_cpu = time.process_time() - proc_cpu0
        finally:
            server.close()
    finally:
        worker.close()
        sink.close()
        sys.setswitchinterval(old_interval)
    if client.returncode != 0:
        raise RuntimeError(f"host bench client failed: {stderr.strip().splitlines()[-1:]}")
    got = json.loads(stdout.strip().splitlines()[-1])
    tokens = got["tokens"]
    owner_s, front_s = cpu1[0] - cpu0[0], cpu1[1] - cpu0[1]
    facts = {"api": api, "streams": streams, "max_tokens": max_tokens, "prompt_tokens": prompt_tokens,
             "forward": "instant" if instant else "real", "switch_interval_s": switch_interval or old_interval,
             "tokens": tokens, "expected_tokens": streams * max_tokens, "client_seconds": round(got["seconds"], 4),
             "wall_s": round(wall, 4), "tok_s": round(tokens / got["seconds"], 1) if got["seconds"] > 0 else None,
             "owner_cpu_s": round(owner_s, 4), "front_cpu_s": round(front_s, 4), "process_cpu_s": round(proc_cpu, 4),
             "owner_us_per_token": round(owner_s / tokens * 1e6, 2) if tokens else None,
             "front_us_per_token": round(front_s / tokens * 1e6, 2) if tokens else None,
             "log": str(log_path)}
    facts |= step_split(log_path, max(1, int(streams * WIDE_SHARE)))
    return facts


def step_split(log: Path, wide: int) -> dict:
    """From the server's step records: at wide steps, step / wait / gap (ms) and the gap's parts (µs per step
    and per token)."""
    steps = [json.loads(x) for x in log.read_text().splitlines() if '"event":"step"' in x]
    steps = [s for s in steps if "start_ns" in s]
    pairs = [(a, b) for a, b in zip(steps, steps[1:]) if a["num_seqs"] >= wide and b["num_seqs"] >= wide]
    out = {"wide_batch": wide, "wide_steps": sum(1 for s in steps if s["num_seqs"] >= wide),
           "wide_step_ms": percentiles([(s["t_ns"] - s["start_ns"]) / 1e6 for s in steps if s["num_seqs"] >= wide]),
           "wide_wait_ms": percentiles([s.get("wait_s", 0.0) * 1e3 for s in steps if s["num_seqs"] >= wide]),
           "wide_gap_ms": percentiles([(b["start_ns"] - a["t_ns"]) / 1e6 for a, b in pairs])}
    parts = {}
    for part in GAP_PARTS:
        vals = [b.get("before", {}).get(part + "_us") for a, b in pairs]
        vals = [v for v in vals if v is not None]
        per_tok = [b["before"][part + "_us"] / a["num_seqs"] for a, b in pairs if part + "_us" in b.get("before", {})]
        parts[part] = {"us_per_step": percentiles(vals), "us_per_token_p50": percentiles(per_tok)["p50"]}
    out["wide_gap_parts"] = parts
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m labkit.bench.host", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--api", default="native", choices=("native", "openai"))
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--real-forward", action="store_true", help="the tiny model's real forward (slow on a CPU)")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for the run (s)")
    ap.add_argument("--out", type=Path, default=None, help="evidence JSON (default: print the facts)")
    ap.add_argument("--client", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.client:
        _client_main(a.client, a.api, a.streams, a.max_tokens, a.prompt_tokens)
        return 0
    if not a.model:
        ap.error("--model DIR is required")
    facts = run_host_bench(a.model, a.api, a.streams, a.max_tokens, a.prompt_tokens, instant=not a.real_forward,
                           switch_interval=a.switch_interval)
    print(json.dumps(facts, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
