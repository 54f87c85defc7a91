"""Renderers of the setup commands' records: doctor, smoke, the walks, generate, the serve bench rows."""
from __future__ import annotations

from typing import Any

from labkit.console import console, dict_table, kv_table, note, num, readable, rel
from labkit.doctor import toolchain_summary


def render_doctor(record: dict) -> None:
    facts = record["facts"]
    imports = {k: (v["version"] if v["ok"] else f"missing ({v['error']})") + ("" if v["required"] else "  [optional]")
               for k, v in facts["imports"].items()}
    console.print(kv_table(imports, title="packages"))
    tc = facts["tensor_check"]
    console.print(kv_table({
        "python": facts["python"]["executable"],
        "device": record["device"],
        "tensor check": f"{tc['op']} {tc['shape']} {tc['dtype']} on {tc['device']}: max abs err {tc['max_abs_err']:.2e} (tol {tc['tol']:g})",
        "runs/": f"{facts['runs_writable']['dir']} ({'writable' if facts['runs_writable']['ok'] else facts['runs_writable']['error']})",
        "engine": (f"{facts['engine_import']['path']}: {facts['engine_run']['output_tokens']} token in "
                   f"{facts['engine_run']['generate_seconds']} s ({facts['engine_run']['attention_backend']})"
                   if facts["engine_run"]["ok"] else f"{facts['engine_import']['path']}: {facts['engine_run']['error']}"),
        "flash-attn": _flash_line(facts.get("flash_attn")),
        **(toolchain_summary(facts["toolchain"]) if "toolchain" in facts else {}),   # absent in older evidence
        "evidence kind": record["kind"],
    }, title="machine"))
    if "engine" in facts:
        console.print(kv_table(doctor_engine_rows(facts["engine"]), title="engine KV pool (docs/LAB.md §11)"))


def _flash_line(f: dict | None) -> str:
    """doctor's flash-attn row: what it found and what that can run."""
    if not f:
        return "not checked"
    if not f["found"]:
        return f["why"]
    text = f"{readable(f.get('version'))} ({f['build']} build, {f['location']}): {f['runs']}"
    if f.get("imports") is False:
        text += f"; does not import: {f['import_error']}"
    if f.get("arch_note"):
        text += f"; {f['arch_note']}"
    return text


def gib(n: int | float | None, missing: str = "n/a") -> str:
    """Bytes in GiB (3 significant digits), with MiB beside it below 1 GiB."""
    if n is None:
        return missing
    text = f"{n / 2**30:.3g} GiB"
    return text if n >= 2**30 else f"{text} ({n / 2**20:.3g} MiB)"


def doctor_engine_rows(e: dict) -> dict:
    """``doctor --engine``'s KV pool rows: memory in GiB, a block in bytes and MiB."""
    mem = e["memory"]
    return {
        "attention / dtype": f"{e['attention_backend']} / {e['dtype']}",
        "weights": gib(mem.get("weights_bytes"), "n/a (CPU budget)"),
        "peak work memory": gib(mem.get("peak_work_bytes"), "n/a (CPU budget)"),
        "KV budget": gib(mem.get("kv_budget_bytes")),
        "bytes per block": f"{e['bytes_per_block']} ({e['mib_per_block']} MiB, {e['block_size']} tokens)",
        "blocks": f"{e['num_blocks']} ({e['tokens_in_pool']} tokens)",
    }


def render_smoke(record: dict) -> None:
    f = record["facts"]
    console.print(kv_table({"prompt tokens": f["prompt_tokens"], "output token ids": f["output_token_ids"],
                            "text": f["text"], "kv_blocks": f["kv_blocks"],
                            "attention": record["engine"]["attention_backend"],
                            "model": record["model"]["path"]}, title="smoke"))


def render_quick_walk(record: dict) -> None:
    f = record["facts"]
    def blocks(d: dict, key: str, i: int, count: int) -> str:
        ids = d.get(key)            # block ids (evidence before they were recorded: the count only)
        return f"blocks {ids[i]}" if ids is not None else f"{count} blocks"

    rows = [{"step": d["step"], "phase": d["phase"],
             "before (label total/cached/scheduled, block ids)": "  ".join(
                 f"{b[0]} {b[1]}/{b[2]}/{b[3]} {blocks(d, 'before_blocks', i, b[4])}" for i, b in enumerate(d["before"])),
             "after (label total/cached, block ids)": "  ".join(
                 f"{a[0]} {a[1]}/{a[2]} {blocks(d, 'after_blocks', i, a[3])}" for i, a in enumerate(d["after"])),
             "finished": ",".join(d["finished"])} for d in f["step_digest"]]
    console.print(dict_table(rows, title=f"quick-walk {f['case']}: {f['title']}"))
    console.print(f"steps={f['num_steps']} output_counts={f['output_counts']}")
    if record["checkpoint"] is None:
        note("no checkpoint states the expectations for these options: facts recorded, nothing asserted")


def render_generate(record: dict, path) -> None:
    for r in record["facts"]["requests"]:
        console.print(kv_table({"prompt tokens": r["prompt_tokens"], "output token ids": r["output_token_ids"],
                                "text": r["text"], "finish": r["finish_reason"]}, title="output"))
    if record["facts"].get("note"):
        note(record["facts"]["note"])
    console.print(f"evidence: {rel(path)}")


def render_facts_json(record: dict) -> None:
    console.print_json(data={k: v for k, v in record["facts"].items()})


def _p50(value) -> Any:
    return value.get("p50") if isinstance(value, dict) else value


def bench_serve_rows(facts: dict) -> list[dict]:
    """``bench --workload serve``: one row per run (offline cold and warm, each served API and mode); the
    whole facts stay in the evidence file."""
    off = facts["offline"]
    warm = off["warm"].get("tok_s")
    served = facts.get("ab") or [{"mode": "engine-process" if facts.get("engine_process") else "in-process",
                                  "native": facts["native"], "openai": facts["openai"]}]
    runs = [("offline cold", off["cold"]), ("offline warm", off["warm"])]
    runs += [(f"{api} ({run['mode']})", run[api]) for run in served for api in ("native", "openai")]
    return [{"run": name, "requests": rec.get("completed", rec.get("requests")),
             "output tokens": rec.get("output_tokens"), "tok/s": num(rec.get("tok_s")),
             "x offline warm": num(round(rec["tok_s"] / warm, 3)) if rec.get("tok_s") and warm else "-",
             "TTFT p50 (ms)": num(_p50(rec.get("ttft_ms")))} for name, rec in runs]
