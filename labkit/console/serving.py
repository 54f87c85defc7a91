"""Renderers of the service side: the serving banner, the client, load, the parallel report, simulate."""
from __future__ import annotations

from rich.table import Table

from labkit.console import console, kv_table, note, num, pcts, rel, short


def observer_table(summary: dict, title: str) -> Table:
    table = Table(title=title, title_justify="left", caption="latencies in ms, p50 / p99", caption_justify="left")
    for col in ("observer", "req", "done", "rej", "out tok", "queue wait", "TTFT", "ITL", "TPOT", "tok/s", "window s"):
        table.add_column(col, justify="left" if col == "observer" else "right", no_wrap=True)
    two = ("p50", "p99")
    for obs, o in summary["observers"].items():
        table.add_row(obs, str(o["requests"]), str(o["completed"]), str(o["rejections"]), str(o["output_tokens"]),
                      pcts(o.get("queue_wait_ms") or {}, two), pcts(o["ttft_ms"], two), pcts(o["itl_ms"], two), pcts(o["tpot_ms"], two),
                      num(o.get("throughput_tok_s")), num((o.get("window") or {}).get("seconds")))
    return table


def render_serving(worker, out) -> None:
    """``labkit serve``'s banner once the worker is ready."""
    served = worker.served
    console.print(kv_table(serving_banner(worker, out), title="labkit serve"))
    if served.model.get("synthetic"):
        note("synthetic model: random weights; generated text is meaningless")


def serving_banner(worker, out) -> dict:
    """The banner's rows: the served engine as it was built (max model len as fitted, TP size) and the limits."""
    from serve.core.fair import per_request_cap

    served, cfg, args = worker.served, worker.config, worker.config.engine
    desc = served.describe() or {}
    conf, kv = desc.get("config") or {}, desc.get("kv_cache") or {}
    return {"worker": worker.worker_id, "kind": served.kind,
            "model": served.model.get("path"), "synthetic": served.model.get("synthetic"),
            "tensor parallel size": served.config.tensor_parallel_size,
            "max model len": served.max_model_len,
            "attention / dtype / KV cache": f"{desc.get('attention_backend', '?')} / {desc.get('dtype', '?')} / "
                                            f"{'e4m3' if kv.get('kv_cache_dtype') == 'fp8' else kv.get('dtype', '?')}",
            "steps / graphs / overlap": f"{'mixed' if conf.get('mixed_batches') else 'prefill or decode'} / "
                                        f"{'on' if (desc.get('graph') or {}).get('enabled') else 'off'} / "
                                        f"{'on' if conf.get('overlap') else 'off'}",
            **lab_levers(desc),
            "scheduling policy": args.scheduling_policy,
            "max num batched tokens / seqs": f"{args.max_num_batched_tokens} / {args.max_num_seqs}",
            "max active / per request / queue": f"{cfg.max_active} / "
                                                f"{per_request_cap(cfg.max_active, cfg.max_active_per_request)} / "
                                                f"{cfg.queue_size} requests",
            "KV blocks": served.num_blocks,
            "log": str(out) if out else "(none)"}


def lab_levers(desc: dict) -> dict:
    """A banner row naming the LAB_* levers the engine was built with away from their defaults (none by default).
    LAB_PREFILL_AHEAD applies with the overlapped decode in nano-vllm's step model only, LAB_DECODE_PROLOGUE with
    the Triton backend in that step model (the model's q/k route says which it took)."""
    from engine.levers import PREFILL_AHEAD_DEFAULT, decode_knobs_text, prefill_ahead_name

    on, conf = [], desc.get("config") or {}
    ahead = prefill_ahead_name(bool(desc.get("prefill_ahead")), bool(desc.get("decode_behind_prefill")),
                               bool(desc.get("prefill_behind_prefill")))
    step_model = conf.get("overlap") and not conf.get("mixed_batches")
    if step_model and ahead != PREFILL_AHEAD_DEFAULT:
        on.append(f"LAB_PREFILL_AHEAD={ahead}")
    if step_model and ahead == "prefills" and not desc.get("admit_in_flight"):
        on.append("LAB_ADMIT_IN_FLIGHT=0")              # (where it applies it is on unless asked off)
    if (desc.get("gemv_rows") or 0) > 1:
        on.append(f"LAB_GEMV_ROWS={desc['gemv_rows']}")
    if desc.get("skinny_rows"):
        on.append(f"LAB_SKINNY_GEMM={desc['skinny_rows']}")
    model = desc.get("model") or {}
    prologue = {"fused": "0", "decode-prologue-noprefetch": "noprefetch"}.get(model.get("qk_norm_rope_kv"))
    if prologue and desc.get("attention_backend") == "triton" and not conf.get("mixed_batches"):
        on.append(f"LAB_DECODE_PROLOGUE={prologue}")      # (its default takes the route "decode-prologue")
    if model.get("decode_layer"):
        on.append("LAB_DECODE_LAYER=1")
    if model.get("l2_prefetch", "0") != "0":
        on.append(f"LAB_L2_PREFETCH={model['l2_prefetch']}")
    if (desc.get("kv_cache") or {}).get("v_transposed"):
        on.append("LAB_FP8_V_T=1")
    if desc.get("fp8_decode"):
        on.append(f"LAB_FP8_DECODE={decode_knobs_text(desc['fp8_decode'])}")
    if desc.get("decode_knobs"):
        on.append(f"LAB_DECODE={decode_knobs_text(desc['decode_knobs'])}")
    return {"lab levers": ", ".join(on)} if on else {}


def render_served(summary: dict) -> None:
    console.print(kv_table({"finished": summary["finished"], "tokens": summary["generation_tokens"],
                            "steps": summary["steps"], "engine errors": summary["engine_errors"]}, title="served"))


def render_client(res: dict, text: bool = True) -> None:
    """The client's result; ``text=False`` when the text was already streamed to the terminal."""
    console.print(kv_table({k: res[k] for k in ("request_id", "worker_id", "status", "reason", "cause",
                                                "message", "tokens", "tokens_after_finished", "ttft_ms",
                                                "kind", "out")}, title="labkit client"))
    if text:
        console.print(res["text"], markup=False, highlight=False)
    if (res.get("model") or {}).get("synthetic"):
        note("synthetic model: random weights; generated text is meaningless")


def render_load(record: dict, mode: str, events) -> None:
    summary = record["facts"]["summary"]
    console.print(observer_table(summary, f"labkit load ({summary.get('kind') or 'kind unknown'}, {mode})"))
    if record["facts"].get("profile"):
        p = record["facts"]["profile"]
        console.print(f"profile: {rel(p['trace'])}, {rel(p['operators'])}, {rel(p['evidence'])}")
    console.print(f"events: {rel(events)}")
    if summary.get("note"):
        note(summary["note"])


def render_report(result: dict, out) -> None:
    for i, s in enumerate(result["inputs"]):
        console.print(observer_table(s, f"{i}: {rel(s['path'])} ({s.get('kind') or 'kind unknown'})"))
        if s.get("note"):
            note(s["note"])
    for row in result["ratios"]:
        console.print(f"ratios vs input 0 ({result['primary_observer']}): " +
                      ", ".join(f"{k} {num(v)}" for k, v in row.items() if k not in ("input", "vs")), soft_wrap=True)
    console.print(f"wrote {rel(out)}, {rel(result['markdown'])}" +
                  "".join(f", {rel(p)}" for p in result["plots"]), soft_wrap=True)
    if result.get("plots_note"):
        note(result["plots_note"])


def render_simulate(record: dict) -> None:
    table = Table(title="labkit simulate", title_justify="left")
    for col in ("scenario", "ok", "facts"):
        table.add_column(col, overflow="fold")
    for name, sc in record["facts"]["scenarios"].items():
        facts = {k: v for k, v in sc.items() if k not in ("ok", "policy", "messages", "over_message")}
        table.add_row(name, "yes" if sc.get("ok") else "NO", short(facts, 160))
    console.print(table)
    console.print(f"events: {record['facts']['events']}")
