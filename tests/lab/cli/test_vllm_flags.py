"""vLLM's command-line habits: ``labkit serve``'s --dtype, --seed, -tp and --block-size reach the engine it
serves; ``labkit trace`` and ``labkit load`` take ``vllm bench serve``'s spellings (--num-prompts,
--random-input-len, --random-output-len, --dataset-name, --base-url) and ``load`` its --max-concurrency;
the load progress bar shows its label, never the markup around it."""
from __future__ import annotations

import io
import json

import pytest
from typer.testing import CliRunner


@pytest.fixture
def served_config(monkeypatch):
    """``labkit serve`` up to the point it would start serving: the worker configuration it would serve with."""
    import serve.entrypoints.launch as launch

    seen = {}

    def fake_run_serve(cfg, host, port, out=None, **kw):
        seen["cfg"], seen["kw"] = cfg, kw
        return {"finished": {}, "generation_tokens": 0, "steps": {}, "engine_errors": 0, "log": None}

    monkeypatch.setattr(launch, "run_serve", fake_run_serve)
    return seen


def test_serve_takes_vllms_engine_flags(cli_app, served_config, tiny_model_dir, tmp_path):
    res = CliRunner().invoke(cli_app, ["serve", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
                                       "--seed", "7", "-tp", "1", "--block-size", "16", "--no-event-log"])
    assert res.exit_code == 0, res.output
    engine = served_config["cfg"].engine
    assert (engine.dtype, engine.seed, engine.tensor_parallel_size, engine.kvcache_block_size) == \
        ("float32", 7, 1, 16)
    assert engine.model == str(tiny_model_dir)
    res = CliRunner().invoke(cli_app, ["serve", "--device", "cpu", "--no-event-log"])
    engine = served_config["cfg"].engine
    assert res.exit_code == 0 and (engine.dtype, engine.seed, engine.kvcache_block_size) == ("auto", 0, 256)


def test_serve_refuses_a_bad_dtype_in_one_line(cli_app, served_config):
    res = CliRunner().invoke(cli_app, ["serve", "--device", "cpu", "--dtype", "float8", "--no-event-log"])
    assert res.exit_code == 2 and "--dtype must be one of" in res.output and "Traceback" not in res.output


def test_trace_takes_vllm_bench_serve_spellings(cli_app, tmp_path):
    ours, theirs = tmp_path / "ours.jsonl", tmp_path / "theirs.jsonl"
    a = CliRunner().invoke(cli_app, ["trace", "--dataset", "random", "--num-requests", "5", "--input-len", "20",
                                     "--output-len", "4", "--range-ratio", "0.5", "-o", str(ours)])
    b = CliRunner().invoke(cli_app, ["trace", "--dataset-name", "random", "--num-prompts", "5",
                                     "--random-input-len", "20", "--random-output-len", "4",
                                     "--range-ratio", "0.5", "-o", str(theirs)])
    assert a.exit_code == 0 and b.exit_code == 0, a.output + b.output
    assert ours.read_bytes() == theirs.read_bytes()
    c = CliRunner().invoke(cli_app, ["trace", "--dataset-name", "prefix_repetition", "--num-prompts", "3",
                                     "-o", str(tmp_path / "p.jsonl")])
    assert c.exit_code == 0, c.output
    head = json.loads((tmp_path / "p.jsonl").read_text().splitlines()[0])
    assert head["options"]["dataset"] == "prefix-repetition"


def test_load_takes_base_url_and_max_concurrency(cli_app, monkeypatch, tmp_path):
    import labkit.load.replay as replay

    seen = {}

    def fake_run_load(opts):
        seen["opts"] = opts
        raise SystemExit(0)

    monkeypatch.setattr(replay, "run_load", fake_run_load)
    res = CliRunner().invoke(cli_app, ["load", "--base-url", "http://127.0.0.1:9", "--max-concurrency", "3",
                                       "-o", str(tmp_path / "l.jsonl")])
    assert res.exit_code == 0, res.output
    assert seen["opts"].endpoints == ["http://127.0.0.1:9"] and seen["opts"].max_concurrency == 3
    res = CliRunner().invoke(cli_app, ["load", "--max-concurrency", "0"])
    assert res.exit_code == 2


def test_the_progress_bar_shows_its_label_not_markup(monkeypatch):
    import labkit.console as console
    from labkit.load import replay

    out = io.StringIO()
    monkeypatch.setattr(console, "err_console", console.LabConsole(file=out, force_terminal=True, width=80,
                                                                   highlight=False, markup=False, emoji=False))

    class Opts:
        show_progress = True

    with replay._progress(Opts(), 2, "load") as bar:
        bar.advance(bar.add_task("load", total=2))
    text = out.getvalue()
    assert "load" in text and "[bold]" not in text


def test_generate_takes_its_prompts_as_arguments(cli_app, tiny_model_dir, tmp_path):
    """`labkit generate --model M "PROMPT"` as well as `-p PROMPT`: positional prompts first, then --prompt's."""
    out = tmp_path / "g.json"
    res = CliRunner().invoke(cli_app, ["generate", "Hello there", "--model", str(tiny_model_dir), "--device", "cpu",
                                       "-p", "Bye", "--max-tokens", "2", "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    facts = json.loads(out.read_text())["facts"]
    texts = [r["prompt"] for r in facts["requests"]]
    assert texts == ["Hello there", "Bye"], texts
