"""The rate sweep's side of ``labkit load`` (``--request-rates``): its options made into
:class:`labkit.load.sweep.SweepOptions`, and its rich table. ``labkit.cli.service.load`` calls
:func:`sweep_command` when ``--request-rates`` is given."""
from __future__ import annotations

from labkit.console import console, note, rel


def sweep_command(load_opts, request_rates: str, goodput: list[str] | None, stop_at_saturation: bool,
                  offline_baseline: bool, serve_process: bool = False) -> dict:
    from labkit.load.sweep import SweepOptions, run_sweep
    from labkit.load.sweep_metrics import parse_goodput, parse_rates

    opts = SweepOptions(load=load_opts, rates=parse_rates(request_rates), goodput=parse_goodput(goodput),
                        stop_at_saturation=stop_at_saturation, offline_baseline=offline_baseline,
                        serve_process=serve_process)
    return run_sweep(opts)


def _q(d: dict, q: str) -> str:
    v = (d or {}).get(q)
    return "–" if v is None else (f"{v:.1f}" if v >= 10 else f"{v:.2f}")


def _n(v) -> str:
    if v is None:
        return "n/a"
    return f"{v:.3g}" if isinstance(v, float) and v < 10 else (f"{v:,.1f}" if isinstance(v, float) else str(v))


def render_sweep(record: dict) -> None:
    from rich.table import Table

    facts = record["facts"]
    slos = facts.get("goodput_slos_ms") or {}
    attention = (record.get("engine") or {}).get("attention_backend")
    served = f", attention {attention}" if attention else ""
    table = Table(title=f"labkit load --request-rates ({record.get('kind') or 'kind unknown'}, {facts['target']}"
                        f"{served})", title_justify="left")
    cols = ["rate req/s", "sent", "completed", "rejected", "errored", "timed out", "req/s", "out tok/s",
            "goodput req/s", "prefix hit"]
    for c in cols:
        table.add_column(c, justify="right")
    lat = Table(title="latency per rate, ms: p50 / p90 / p99 (client-observed)", title_justify="left")
    for c in ("rate req/s", "TTFT", "TPOT", "ITL", "E2E"):
        lat.add_column(c, justify="right")
    for r in facts["per_rate"]:
        good = r.get("goodput")
        hit = r.get("prefix_cache_hit_rate")
        table.add_row(str(r["offered_rate"]), str(r["sent"]), str(r["completed"]), str(r["rejected"]),
                      str(r["errored"]), str(r["timed_out"]), _n(r["request_throughput"]),
                      _n(r["output_throughput_tok_s"]), _n(good["req_s"]) if good else "no SLO",
                      "n/a" if hit is None else f"{hit:.0%}")
        lat.add_row(str(r["offered_rate"]), *(" / ".join(_q(r[k], q) for q in ("p50", "p90", "p99"))
                                              for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")))
    console.print(table)
    console.print(lat)
    steps = _steps_table(facts["per_rate"])
    if steps is not None:
        console.print(steps)
    s = facts["summary"]
    console.print(f"first saturated rate: {s['first_saturated_rate']}; TTFT p99 over {s['ttft_p99_limit_ms']:g} ms "
                  f"from rate: {s['first_rate_ttft_p99_over_limit']}; best throughput "
                  f"{_n(s['max_output_throughput_tok_s'])} tok/s"
                  + (f"; offline {_n(facts['offline']['tok_s'])} tok/s (served/offline "
                     f"{s.get('served_over_offline')})" if facts.get("offline") else ""), soft_wrap=True)
    if slos:
        console.print("goodput SLOs: " + ", ".join(f"{k.removesuffix('_ms')} <= {v:g} ms" for k, v in slos.items()))
    if facts.get("skipped_rates"):
        note(f"stopped at saturation: rates {', '.join(facts['skipped_rates'])} not run")
    console.print(f"picture: {rel(facts['picture'])}; per-rate logs: {rel(facts['per_rate'][0]['events'])} ...",
                  soft_wrap=True)


def _steps_table(rows: list[dict]):
    """The server's steps per rate (labkit.load.server_steps): decode steps' batch and times, the share of the
    rate's time in prefill and mixed steps, the GPU's busy fraction; None where no rate has them."""
    from rich.table import Table

    if not any(r.get("server_steps") for r in rows):
        return None
    t = Table(title="server steps per rate (the engine's step records): decode p50s, ms; a decode's TPOT is its step "
                    "plus the other steps between", title_justify="left")
    for c in ("rate req/s", "steps", "decode batch", "decode interval", "decode GPU", "prefill/mixed share",
              "GPU busy"):
        t.add_column(c, justify="right")
    for r in rows:
        st = r.get("server_steps")
        if not st:
            continue
        d = st["decode"]
        kinds = " / ".join(f"{n} {k}" for k, n in sorted(st["kinds"].items()))
        share, busy = st["other_kinds_share"], st["gpu_busy_fraction"]
        t.add_row(str(r["offered_rate"]), kinds, _n(d["batch_p50"]), _q(d, "interval_ms_p50"), _q(d, "gpu_ms_p50"),
                  "n/a" if share is None else f"{share:.0%}", "n/a (no GPU spans)" if busy is None else f"{busy:.0%}")
    return t
