"""``labkit principles tokenizer|softmax|attention|uncached|memory|slots|timing|residual|hash`` (docs/LAB.md §2, §6, §8,
§9, §11, §18) and ``labkit multiturn`` (§18). Thin shells over labkit/experiments/principles.py, uncached_walk.py and
multiturn.py; every
command ends through :func:`labkit.cli.app.finish`.

``register_principles(group)`` adds the principle commands to the ``principles`` group (made in
labkit/cli/guardrails.py); ``register(app)`` adds ``multiturn``.
"""
from __future__ import annotations

import json

import typer

from labkit.cli.app import finish
from labkit.cli.options import AttentionOpt, DeviceOpt, JsonOpt, ModelOpt, OutOpt
from labkit.console import console, dict_table, kv_table, note, readable

EXIT_HELP = "Exit codes: 0 PASS/REVIEW, 1 FAIL, 2 user error."


def _model(model) -> str | None:
    return str(model) if model else None


def _show(record: dict, rows: dict, title: str, json_out: bool) -> None:
    if not json_out:
        console.print(kv_table({k: v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for k, v in rows.items()},
                               title=title))
        if (record.get("facts") or {}).get("note"):
            note(record["facts"]["note"])
    finish(record, record["_paths"]["json"], json_out=json_out)


def principles_tokenizer(model: ModelOpt = None, out: OutOpt = None, json_out: JsonOpt = False) -> None:
    """Encode/decode a fixed Chinese/English text with the model's tokenizer; pieces; chat template (docs/LAB.md §2)."""
    from labkit.experiments.principles import run_tokenizer

    r = run_tokenizer(out, _model(model))
    f = r["facts"]
    _show(r, {"text": f["text"], "ids": f["ids"], "token_pieces": f["token_pieces"], "decoded": f["decoded"],
              "round trip equal": f["roundtrip_equal"], "chat template (thinking off)": f["chat_template_text"]},
          "tokenizer", json_out)


def principles_softmax(
    samples: int = typer.Option(20000, "--samples", min=1, help="Draws at temperature 1."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampler's generator."),
    out: OutOpt = None, json_out: JsonOpt = False,
) -> None:
    """softmax([2,1,0]), the greedy pick and sampled frequencies from the engine's sampler (docs/LAB.md §2)."""
    from labkit.experiments.principles import run_softmax

    r = run_softmax(out, samples, seed)
    f = r["facts"]
    _show(r, {"scores": f["scores"], "probabilities": [round(p, 5) for p in f["probabilities"]],
              "greedy index": f["greedy_index"], f"frequencies ({f['samples']} draws)": f["sampled_frequencies"]},
          "softmax and sampling", json_out)


def principles_attention(out: OutOpt = None, json_out: JsonOpt = False) -> None:
    """Causal attention by hand on Q=K=V=X through the engine's torch backend; mask and cache checks (docs/LAB.md §8)."""
    from labkit.experiments.principles import run_attention

    r = run_attention(out)
    f = r["facts"]
    rnd = lambda xs: [round(x, 4) for x in xs]  # noqa: E731
    _show(r, {"weights": [rnd(w) for w in f["weights"]], "last output": rnd(f["last_output"]),
              "masked earlier delta": f["masked_earlier_delta"],
              "unmasked earlier delta": round(f["unmasked_earlier_delta"], 5),
              "cached last output": rnd(f["cache"]["cached_last_output"]),
              "cache max error": f["cache"]["max_error"],
              "query positions (full, cached) / KV": f"{readable(f['cache']['query_positions'])} / {f['cache']['kv_positions']}",
              "engine decode: query rows / K/V slots written": f"{f['cache']['decode_output_rows']} / {f['cache']['kv_slots_written']}",
              "V != Q/K: last output": [round(x, 6) for x in f["v_differs"]["last_output"]]},
          "causal attention", json_out)


def principles_uncached(out: OutOpt = None, json_out: JsonOpt = False) -> None:
    """A toy network with no KV cache: three rounds of 3, 4, 5 input positions, one position traced through
    every layer; the causal prefix error; the same three tokens from the cached path (docs/LAB.md §8)."""
    from labkit.experiments.uncached_walk import run_uncached

    r = run_uncached(out)
    f = r["facts"]
    if not json_out:
        console.print(dict_table([{"round": x["round"], "input ids": readable(x["input_ids"]),
                                   "hidden rows x cols": " ".join("x".join(map(str, s)) for s in x["hidden_shapes"]),
                                   "scores, each block": " ".join("x".join(map(str, s)) for s in x["score_shapes"]),
                                   "next id": x["next_id"]} for x in f["rounds"]],
                                 title="uncached: every round feeds the whole sequence"), soft_wrap=True)
        stages = ["embedding"] + [f"block{b}.{k}" for b in range(f["network"]["blocks"])
                                  for k in ("norm", "q", "k", "v", "attention", "residual", "mlp", "output")]
        rows = []
        for stage in stages + ["logits"]:
            values = []
            for x in f["rounds"]:
                value = x["trace"]
                for part in stage.split("."):
                    value = value[part]
                values.append(value)
            moved = max(abs(a - b) for later in values[1:] for a, b in zip(later, values[0]))
            rows.append({"stage": stage, "round 1": readable([round(v, 3) for v in values[0]]),
                         "moved later": f"{moved:.3g}"})
        title = f"position {f['traced_position']} (the prompt's last): round 1's vectors, the most any moved later"
        console.print(dict_table(rows, title=title), soft_wrap=True)
    _show(r, {"input widths": f["input_widths"], "total input positions": f["total_input_positions"],
              "causal prefix error": f"{f['causal_prefix_error']:.3g}",
              "attention by hand vs the engine layer": f"{f['attention_hand_vs_engine_max_error']:.3g}",
              "generated ids": f["generated_ids"],
              "cached: input widths / total": f"{readable(f['cached']['input_widths'])} / "
                                               f"{f['cached']['total_input_positions']}",
              "cached: generated ids / last-logit error": f"{readable(f['cached']['generated_ids'])} / "
                                                          f"{f['cached']['max_last_logit_error']:.3g}"},
          "uncached walkthrough", json_out)


def principles_memory(model: ModelOpt = None, out: OutOpt = None, json_out: JsonOpt = False) -> None:
    """KV bytes per token, per request, per block; the static pool budget (docs/LAB.md §11)."""
    from labkit.experiments.principles import run_memory

    r = run_memory(out, _model(model))
    f = r["facts"]
    b = f["static_budget"]
    _show(r, {"KV per token": f"{f['kv_bytes_per_token']} B = {f['kv_kib_per_token']:g} KiB",
              f"{f['positions']} positions": f"{f['kv_mib_per_request']:g} MiB",
              f"{f['requests']} requests": f"{f['kv_gib_for_requests']:g} GiB",
              f"one {f['block_size']}-token block": f"{f['kv_mib_per_block']:g} MiB",
              "static budget": f"{b['budget_gib']:g} GiB - {b['weights_gib']} GiB weights - {b['reserve_gib']:g} GiB = "
                               f"{b['kv_gib']} GiB -> {b['pool_blocks']} blocks -> {b['requests_that_fit']} requests"},
          "KV memory", json_out)


def principles_slots(model: ModelOpt = None, out: OutOpt = None, json_out: JsonOpt = False) -> None:
    """Logical position -> physical KV slot: the teaching example and a real walk at block size 4 (docs/LAB.md §6)."""
    from labkit.experiments.principles import run_slots

    r = run_slots(out, _model(model))
    f = r["facts"]
    _show(r, {"block size": f["block_size"], "block_table": f["teaching"]["block_table"],
              "positions -> slots": f"{f['teaching']['positions']} -> {f['teaching']['slots']}",
              "runtime slots checked": f["runtime"]["slots_checked"],
              "runtime follows formula": f["runtime"]["slots_follow_formula"],
              "blocks at B=256 for 255/256/257": f["logical_blocks_at_256"]["blocks"]},
          "KV slots", json_out)


def principles_timing(out: OutOpt = None, json_out: JsonOpt = False) -> None:
    """TTFT, ITL, TPOT and throughput of the guide's worked example through the report's functions (docs/LAB.md §11)."""
    from labkit.experiments.principles import run_timing

    r = run_timing(out)
    f = r["facts"]
    _show(r, {"tokens at (s)": f["tokens_s"], "TTFT ms": f["ttft_ms"], "ITL ms": f["itl_ms"],
              "TPOT ms": round(f["tpot_ms"], 2), "throughput tok/s": f["throughput_tok_s"]}, "timing", json_out)


def principles_hash(model: ModelOpt = None, device: DeviceOpt = "auto", attention: AttentionOpt = "auto",
                    out: OutOpt = None, json_out: JsonOpt = False) -> None:
    """The prefix cache's hash chain: one token changed in block 0, then in block 2; which blocks hit (docs/LAB.md §18)."""
    from labkit.experiments.hash_chain import run_hash

    r = run_hash(out, _model(model), device, attention)
    f = r["facts"]
    if not json_out:
        rows = [{"request": c["label"], "block": b["index"], "id": b["block_id"],
                 "tokens": f"{b['first_token']}..{b['last_token']}", "hash": b["hash"] or "- (partial)",
                 "parent": b["parent"] or "-", "hit": "hit" if b["hit"] else "miss"}
                for c in f["hash_chain"] for b in c["blocks"]]
        console.print(dict_table(rows, title=f"hash chain, block size {f['block_size']}"))
    from labkit.cli.pictures import walk_pictures

    walk_pictures(r, json_out)
    changed = {q["label"]: q["changed_position"] for q in f["requests"] if q["changed_position"] is not None}
    _show(r, {"changed token (position)": changed, "cached tokens": f["cached"],
              "P2 / P3 blocks with P1's hash": f"{json.dumps(f['p2_same_hash_as_p1'])} / {json.dumps(f['p3_same_hash_as_p1'])}",
              "engine's stored hashes match": f["engine_hashes_match"]}, "prefix hash chain", json_out)
def principles_residual(model: ModelOpt = None, device: DeviceOpt = "auto", attention: AttentionOpt = "auto",
                        out: OutOpt = None, json_out: JsonOpt = False) -> None:
    """Layer 0's residual path by hand, h = x + Attn(Norm1(x)), y = h + MLP(Norm2(h)), against the engine's layer; where the norm adds the residual (docs/LAB.md §9)."""
    from labkit.experiments.residual import run_residual

    r = run_residual(out, _model(model), device, attention)
    f = r["facts"]
    if not json_out:
        console.print(dict_table([{"step": i + 1, "T": s["T"], "h: hand vs engine": f"{s['h_rel_diff']:.2e}",
                                   "MLP(Norm2(h))": f"{s['mlp_rel_diff']:.2e}", "y: hand vs next norm": f"{s['y_rel_diff']:.2e}",
                                   "control: no skips": f"{s['without_skips_rel_diff']:.2e}",
                                   "control: no attention skip": f"{s['without_attention_skip_rel_diff']:.2e}"}
                                  for i, s in enumerate(f["steps"])],
                                 title="layer 0, max relative difference (max |a - b| / max |b|)"))
        console.print(dict_table([{"where": k, "file:line": f"{v['file']}:{v['line']}", "function": v["function"],
                                   "source": v["source"]} for k, v in f["sites"].items()],
                                 title="where the residual is added"))
    _show(r, {"formula": f["formula"], "next norm (adds h + MLP output)": f["next_norm"],
              "norm fused (CUDA kernel)": f["norm_fused"]}, "residual path", json_out)


def multiturn(model: ModelOpt = None, device: DeviceOpt = "auto", attention: AttentionOpt = "auto",
              out: OutOpt = None, json_out: JsonOpt = False) -> None:
    """Two chat turns through the template: the common token prefix and turn 2's prefix-cache hit (docs/LAB.md §18)."""
    from labkit.experiments.multiturn import run_multiturn

    r = run_multiturn(out, _model(model), device, attention)
    f = r["facts"]
    if not json_out:
        console.print(dict_table([
            {"engine": "same", **{k: f["turn2_same_engine"].get(k) for k in ("total", "cached", "scheduled", "block_table")}},
            {"engine": "fresh", **{k: f["turn2_fresh_engine"].get(k) for k in ("total", "cached", "scheduled", "block_table")}},
        ], title="turn 2's first schedule"))
    _show(r, {"turn 1 tokens (with answer)": f["turn1"]["tokens_with_answer"], "turn 2 tokens": f["turn2"]["prompt_tokens"],
              "common prefix": f["common_prefix_tokens"], "turn 1 continues": f["after_common"]["turn1"],
              "turn 2 continues": f["after_common"]["turn2"], "expected cached": f["expected_cached"]},
          "multi-turn prefix", json_out)


def register_principles(group: typer.Typer) -> None:
    for name, fn in (("tokenizer", principles_tokenizer), ("softmax", principles_softmax),
                     ("attention", principles_attention), ("uncached", principles_uncached),
                     ("memory", principles_memory),
                     ("slots", principles_slots), ("timing", principles_timing), ("residual", principles_residual),
                     ("hash", principles_hash)):
        group.command(name, epilog=EXIT_HELP)(fn)


def register(app: typer.Typer) -> None:
    app.command("multiturn", epilog=EXIT_HELP)(multiturn)

