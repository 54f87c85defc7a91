"""Where a served step's time goes, from a `labkit serve` event log's step records (labkit/load/server_steps.py):
per load window (a rate of a sweep), per step kind and batch size, the host's view of a step (launch to ids in
hand), the interval between consecutive steps, on CUDA the step's GPU span and the GPU's idle gap before it, and
the share of the steps launched behind a step in flight (ahead: the overlapped lookahead).

    python tools/served_steps.py SERVER_LOG.jsonl [--rate-logs NAME-rate*.jsonl] [--idle-s 1.0] [--json OUT]

With --rate-logs (a sweep's per-rate event logs) each window is a rate: from its first request's submission to its
last one's end, as the engine saw them; without, the log's runs of steps separated by at least --idle-s of no step.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from labkit.errors import UserError
from labkit.load.server_steps import idle_windows, inside, read_steps, request_span, summarize


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--rate-logs", type=Path, nargs="*", default=[])
    ap.add_argument("--idle-s", type=float, default=1.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    try:            # a missing log or a broken line: one line (labkit.evidence.read_jsonl's), exit 2
        steps = read_steps(args.log)
        spans = [(p.stem, request_span(p)) for p in args.rate_logs]
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not steps:
        print(f"error: {args.log} holds no step records", file=sys.stderr)
        return 2
    if args.rate_logs:
        named = [(name, inside(steps, span)) for name, span in spans if span is not None]
    else:
        named = [(f"window {i}", w) for i, w in enumerate(idle_windows(steps, args.idle_s))]
    named = [(name, w) for name, w in named if w]
    result = [{"window": name, **summarize(w)} for name, w in named]
    for w in result:
        print(f"{w['window']}: {w['span_s']} s, {w['steps']} steps {w['kinds']}, GPU busy {w['gpu_busy_fraction']}")
        print(f"  {'kind':8} {'batch<=':>7} {'steps':>6} {'tok':>6} {'interval':>9} {'host':>7} {'gpu':>7} {'gpu idle':>9} "
              f"{'ahead':>6}")
        for r in w["by_kind_and_batch"]:
            f = lambda v: "-" if v is None else f"{v:.3f}"     # noqa: E731
            print(f"  {r['kind']:8} {r['batch_le']:>7} {r['steps']:>6} {f(r['tokens_p50']):>6} "
                  f"{f(r['interval_ms_p50']):>9} {f(r['host_ms_p50']):>7} {f(r['gpu_ms_p50']):>7} "
                  f"{f(r['gpu_idle_ms_p50']):>9} {f(r.get('ahead_share')):>6}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
