"""Renderers of the logits guards' records: collect, compare, calibration, the cached forward, TP shapes."""
from __future__ import annotations

from rich.table import Table

from labkit.console import console, dict_table, kv_table, readable, rel, sci


def _routes_text(facts: dict) -> str:
    routes = facts.get("decode_routes") or {}
    if not routes:
        return "-"
    parts = []
    for batch, r in routes.items():
        where = f"graph@{r['bucket']}" if r.get("route") == "graph" else str(r.get("route"))
        ok = "" if (r.get("route"), r.get("bucket")) == (r.get("expected_route"), r.get("expected_bucket")) else " (unexpected)"
        parts.append(f"{batch}:{where}{ok}")
    return ", ".join(parts)


def render_collect(record: dict) -> None:
    f = record["facts"]
    data = {
        "suite": f"{f['suite']} (seed {f['seed']})",
        "backend": f"{f['backend']}  execution {f['execution']}  attention {f['attention']}  dtype {f['dtype']}",
        "device": record.get("device"),
        "rows": f"{f['num_rows']} / {f['expected_rows']}",
        "trajectory sha256": f["trajectory_sha256"][:16],
    }
    if f.get("backend") == "nano":
        data["decode routes (batch:route)"] = _routes_text(f)
        if f.get("graph_buckets"):
            data["graph buckets"] = ",".join(map(str, f["graph_buckets"]))
    if "kv" in f:
        kv = f["kv"]
        data["history KV unchanged"] = kv["history_unchanged"]
        data["padding wrote nothing"] = kv["padding_wrote_nothing"]
        data["new KV rows"] = f"{kv['new_kv_rows']} {kv['new_kv_shape']}"
    if "expect_uncovered" in f:
        eu = f["expect_uncovered"]
        data["batch 17 decode"] = f"route {eu['route']}, completed {eu['completed']}" + (f", error {eu['error']}" if eu["error"] else "")
    console.print(kv_table(data, title="logits collect"))


def render_compare(record: dict) -> None:
    f = record["facts"]
    th = f["thresholds"]
    summary = {
        "lhs (measured)": f"{rel(f['lhs']['prefix'])}  {f['lhs']['backend']}/{f['lhs']['execution']}/{f['lhs']['attention']} {f['lhs']['dtype']} on {f['lhs']['device']}",
        "rhs (reference)": f"{rel(f['rhs']['prefix'])}  {f['rhs']['backend']}/{f['rhs']['execution']}/{f['rhs']['attention']} {f['rhs']['dtype']} on {f['rhs']['device']}",
        "rows": f"{f['num_rows']} ({f['suite']})",
        "worst max abs": f"{sci(f['worst_max_abs'])} (threshold {th['max_abs'] if th['max_abs'] is None else format(th['max_abs'], 'g')}; median {sci(f['median_max_abs'])})",
        "worst relative L2": f"{sci(f['worst_rel_l2'])} (threshold {th['rel_l2'] if th['rel_l2'] is None else format(th['rel_l2'], 'g')}; median {sci(f['median_rel_l2'])})",
        "top-1 agreement": f"{f['top1_agree']}/{f['num_rows']} ({f['unexplained_top1_flips']} unexplained flips)",
        "first divergent row": (f"#{f['first_divergent_row']['index']} {f['first_divergent_row']['id']} "
                                f"({', '.join(f['first_divergent_row']['failures'])})") if f["first_divergent_row"] else "none",
    }
    kv = f["kv"]
    summary["new KV"] = (f"{kv['rows']} rows, worst max abs {sci(kv['worst_max_abs'])} (threshold {th['kv_max_abs']:g}), "
                         f"worst rel L2 {sci(kv['worst_rel_l2'])}") if kv["compared"] else f"not compared: {kv['why_not']}"
    worst = Table(title=f"{len(f['worst_rows'])} worst rows (by max abs)", title_justify="left")
    for col in ("row", "id", "phase", "len", "max abs", "rel L2", "top-1 lhs/rhs", "ref top-2 margin", "failures"):
        worst.add_column(col, justify="right" if col in ("row", "len", "max abs", "rel L2", "ref top-2 margin") else "left")
    for r in f["worst_rows"]:
        worst.add_row(str(r["index"]), r["id"], r["phase"], str(r["length"]), sci(r["max_abs"]), sci(r["rel_l2"]),
                      f"{r['top1_lhs']}/{r['top1_rhs']}", f"{r['ref_margin']:.4f}", ",".join(r["failures"]) or "-")
    console.print(kv_table(summary, title="logits compare"))
    console.print(worst)


def render_calibration(record: dict) -> None:
    rows = [{"suite": r["suite"], "exec": r["execution"], "dtype": r["dtype"], "backend": r["backend"],
             "worst max abs": f"{r['worst_max_abs']:.3g}", "median max abs": f"{r['median_max_abs']:.3g}",
             "worst rel L2": f"{r['worst_rel_l2']:.3g}", "median rel L2": f"{r['median_rel_l2']:.3g}",
             "top-1 (min)": f"{r['min_top1_agree']}/{r['num_rows']}",
             "verdicts": ",".join(x["verdict"] for x in r["repeats"])} for r in record["facts"]["results"]]
    console.print(dict_table(rows, title=f"logits calibration, {record['facts']['repeats']} repeats on {record['device']}"))


def render_cached_forward(record: dict) -> None:
    f = record["facts"]
    t = Table(title=f"cached vs uncached, S={f['prompt_len']} G={f['steps']} ({f['dtype']} on {f['device']})",
              title_justify="left")
    for col in ("step", "width uncached", "width cached", "max abs", "rel L2", "same top-1"):
        t.add_column(col, justify="right")
    for s in f["per_step"]:
        t.add_row(str(s["step"]), str(s["width_uncached"]), str(s["width_cached"]), sci(s["max_abs"]),
                  sci(s["rel_l2"]), "yes" if s["same_top1"] else "NO")
    console.print(t)
    tm = f["timing"]
    console.print(kv_table({
        "positions": f"uncached {f['positions_uncached']} vs cached {f['positions_cached']} "
                     f"(expected {f['expected']['positions_uncached']} / {f['expected']['positions_cached']}; "
                     f"ratio {f['position_ratio']:.2f})",
        "max abs / rel L2": f"{sci(f['max_abs_logit_error'])} / {sci(f['relative_l2_logit_error'])}",
        "same top-1 steps": f"{f['same_top1_steps']}/{f['steps']}",
        "prefill s (median)": f"uncached {tm['uncached']['median_prefill_s']:.4f}  cached {tm['cached']['median_prefill_s']:.4f}",
        "decode s (median)": f"uncached {tm['uncached']['median_decode_s']:.4f}  cached {tm['cached']['median_decode_s']:.4f}",
        "repeats": f["repeats"],
    }, title="cached-forward"))


def render_tp_shapes(record: dict) -> None:
    for r in record["facts"]["ranks"]:
        console.print(f"rank {r['rank']}: {r['q_heads']} q heads, {r['kv_heads']} kv heads, "
                      f"rows of the TP=1 qkv weight {readable(r['rows_of_tp1_packed_qkv'])}")
    rows = record["facts"].get("qkv_rows_tp1")
    if rows:
        table = Table(title="TP=1 packed qkv weight: rows of q_proj, k_proj, v_proj", title_justify="left")
        for col in ("", "width", "from the config", "loader (shard_range)", "measured (by values)"):
            table.add_column(col)
        for n in "qkv":
            table.add_row(n, str(rows["widths"][n]), _rows(rows["from_config"][n]), _rows(rows["from_loader"][n]),
                          _rows(rows["measured"][n]))
        console.print(table)


def _rows(r) -> str:
    return "not found" if r is None else f"[{r[0]}, {r[1]})"
