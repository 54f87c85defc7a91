"""Model text, paths and user input print literally (no rich markup, no emoji codes)."""
from __future__ import annotations

import pytest

from labkit import console as con
from labkit.console import setup as con_setup

NASTY = ["Hello [/", "[/]", "[the docs](url)", "a [bold]b[/bold] c", "x :smile: y", "[optional]", "[link=http://e]z"]


@pytest.mark.parametrize("text", NASTY)
def test_generate_output_prints_literally(text):
    record = {"facts": {"requests": [{"prompt_tokens": 2, "output_token_ids": [1, 2], "text": text,
                                      "finish_reason": "length"}], "note": f"note {text}"}}
    with con.console.capture() as cap:
        con_setup.render_generate(record, f"/tmp/{text}/g.json")
    assert text in cap.get()


@pytest.mark.parametrize("text", NASTY)
def test_plain_prints_and_error_lines_are_literal(text):
    with con.console.capture() as cap:
        con.console.print(f"wrote {text}")
        con.console.print(con.kv_table({"k": text}, title=f"t {text}"))
    assert cap.get().count(text) == 3
    with con.err_console.capture() as cap:
        con.error_line(f"bad {text}")
        con.note(f"note {text}")
    assert cap.get().count(text) == 2


def test_doctor_optional_label_is_shown():
    record = {"facts": {"imports": {"triton": {"ok": False, "error": "No module", "required": False, "version": None},
                                    "torch": {"ok": True, "version": "2.x", "required": True}},
                        "tensor_check": {"op": "mm", "shape": [2, 2], "dtype": "f32", "device": "cpu",
                                         "max_abs_err": 0.0, "tol": 1e-5},
                        "python": {"executable": "/x/[y]/python"},
                        "runs_writable": {"dir": "runs", "ok": True},
                        "engine_import": {"path": "/x/[engine]"},
                        "engine_run": {"ok": True, "output_tokens": 1, "generate_seconds": 0.1,
                                       "attention_backend": "torch"}},
              "device": "cpu", "kind": "cpu-real-engine"}
    with con.console.capture() as cap:
        con_setup.render_doctor(record)
    out = cap.get()
    assert "[optional]" in out and "/x/[y]/python" in out and "/x/[engine]" in out


def test_generate_command_prints_markup_in_output_literally(cli_app, monkeypatch, tmp_path):
    """The reproducer: a model whose output contains ``[/]`` crashed `labkit generate` with a MarkupError."""
    from typer.testing import CliRunner

    import labkit.experiments.generate as gen

    def fake(prompts, *a, **k):
        return {"facts": {"requests": [{"prompt_tokens": 3, "output_token_ids": [1], "text": "[/] and [the docs](url)",
                                        "finish_reason": "length"}], "note": None}}

    monkeypatch.setattr(gen, "run_generate", fake)
    result = CliRunner().invoke(cli_app, ["generate", "-p", "Hello [/", "--out", str(tmp_path / "g.json")])
    assert result.exit_code == 0, result.output
    assert "[/] and [the docs](url)" in result.output
