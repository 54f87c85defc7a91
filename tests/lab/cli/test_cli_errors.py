"""Errors a user can cause end in one clear line and a non-zero exit, never a traceback (issue 2).

What is about the process (the console script's exit status and stderr, stdin for --debug) runs `python -m
labkit` in a subprocess: ``test_missing_model_dir``, the pdb test and the console-script internal error. The
other cases run the same app in process (the ``labkit_in_process`` fixture of
tests/lab/conftest.py): the errors are mapped by the app's root group, the same code either way, without a
torch import per case."""
import os
import subprocess
import sys

from pathlib import Path

import pytest


def labkit(*args, env=None):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "labkit", *args], capture_output=True, text=True, env=e, timeout=120)


def one_clear_line(res, needle):
    assert res.returncode != 0
    assert "Traceback" not in res.stdout + res.stderr
    errors = [l for l in res.stderr.splitlines() if l.startswith("error:")]
    assert len(errors) == 1 and needle in errors[0], res.stderr


def test_missing_model_dir(tmp_path):
    """The one real process of the error lines: exit status, stderr, no traceback."""
    one_clear_line(labkit("quick-walk", "--case", "A", "--model", str(tmp_path / "nope")), "nope")


def test_missing_model_dir_in_process(tmp_path, labkit_in_process):
    """The same case through the app in process: the same one line (what the in-process cases below rest on)."""
    one_clear_line(labkit_in_process("quick-walk", "--case", "A", "--model", str(tmp_path / "nope")), "nope")


def test_malformed_model_dir(tmp_path, labkit_in_process):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    one_clear_line(labkit_in_process("smoke", "--model", str(bad)), "config.json")


def test_block_size_not_power_of_two(tiny_model_dir, labkit_in_process):
    one_clear_line(labkit_in_process("quick-walk", "--case", "A", "--kv-cache-block-size", "3", "--model",
                                     str(tiny_model_dir)), "power of two")


def test_token_id_outside_vocabulary(tiny_model_dir, tmp_path, labkit_in_process):
    one_clear_line(labkit_in_process("generate", "--token-ids", "1,2,999999", "--model", str(tiny_model_dir),
                                     "--out", str(tmp_path / "g.json")), "outside the vocabulary")


def test_prompt_longer_than_max_model_len(tiny_model_dir, tmp_path, labkit_in_process):
    ids = ",".join(str(i) for i in range(100, 400))
    one_clear_line(labkit_in_process("generate", "--token-ids", ids, "--max-model-len", "128", "--model",
                                     str(tiny_model_dir), "--out", str(tmp_path / "g.json")), "--max-model-len")


def test_unknown_case_is_a_usage_error_without_traceback(tiny_model_dir, labkit_in_process):
    res = labkit_in_process("quick-walk", "--case", "Z", "--model", str(tiny_model_dir))
    assert res.returncode == 2 and "Traceback" not in res.stdout + res.stderr
    assert "'z' is not one of" in res.stderr or "is not one of" in res.stderr


@pytest.mark.parametrize("args,needle", [
    (("--max-tokens", "0"), "--max-tokens must be"),        # the flag typed, not the field (max_tokens)
    (("--temperature", "-1"), "--temperature must be"),
])
def test_bad_sampling_params(tiny_model_dir, tmp_path, args, needle, labkit_in_process):
    one_clear_line(labkit_in_process("generate", "--token-ids", "1,2", *args, "--model", str(tiny_model_dir),
                                     "--out", str(tmp_path / "g.json")), needle)


def test_generate_works_and_says_synthetic(tiny_model_dir, tmp_path, labkit_in_process):
    res = labkit_in_process("generate", "--prompt", "Hello", "--chat", "--max-tokens", "3", "--ignore-eos",
                            "--model", str(tiny_model_dir), "--out", str(tmp_path / "g.json"))
    assert res.returncode == 0, res.stderr
    assert "synthetic" in res.stdout + res.stderr and (tmp_path / "g.json").is_file()


def test_quick_walk_debug_stops_in_pdb_after_init_then_continues(tiny_model_dir, tmp_path):
    e = dict(os.environ)
    res = subprocess.run([sys.executable, "-m", "labkit", "quick-walk", "--case", "A", "--trace", "--debug", "--model",
                          str(tiny_model_dir), "--out", str(tmp_path / "a.json")],
                         input="p type(llm).__name__, len(llm.scheduler.waiting), llm.block_manager.num_blocks\nc\n",
                         capture_output=True, text=True, env=e, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "(Pdb)" in res.stdout and "('LLMEngine', 0," in res.stdout    # engine built, no request added yet
    assert "PASS" in res.stdout


# ------------------------------------------------------------------ the exit table and errors by type


def _raise_in_smoke(monkeypatch, exc: BaseException):
    """Make the smoke command's one call raise ``exc``; return the command's result through the app."""
    from typer.testing import CliRunner

    from labkit.cli import app
    from labkit.experiments import smoke

    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(smoke, "run_smoke", boom)
    return CliRunner().invoke(app, ["smoke", "--out", os.devnull])


def _user_errors():
    from engine.config import ConfigError
    from engine.llm_engine import RequestError
    from labkit.assets.files import ModelError
    from labkit.errors import UserError

    return [UserError("bad flag"), ModelError("bad model dir"), ConfigError("bad config"),
            RequestError("bad request"), FileNotFoundError(2, "No such file or directory", "/x/missing.json")]


@pytest.mark.parametrize("index", range(5))
def test_user_errors_by_type_exit_2_with_one_line(monkeypatch, index):
    monkeypatch.delenv("LABKIT_DEBUG", raising=False)
    exc = _user_errors()[index]
    res = _raise_in_smoke(monkeypatch, exc)
    assert res.exit_code == 2, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "internal error" not in res.output


@pytest.mark.parametrize("exc", [ValueError("a bug that says value"), KeyError("k"),
                                 OSError("no file named"), RuntimeError("boom")])
def test_any_other_exception_is_an_internal_error_not_exit_2(monkeypatch, exc):
    monkeypatch.delenv("LABKIT_DEBUG", raising=False)
    res = _raise_in_smoke(monkeypatch, exc)
    assert res.exit_code == 70, res.output
    lines = [line for line in res.output.splitlines() if line.startswith("internal error:")]
    assert len(lines) == 1 and type(exc).__name__ in lines[0] and "LABKIT_DEBUG=1" in lines[0]
    assert not any(line.startswith("error:") for line in res.output.splitlines())


def test_internal_error_with_labkit_debug_keeps_the_traceback(monkeypatch):
    monkeypatch.setenv("LABKIT_DEBUG", "1")
    res = _raise_in_smoke(monkeypatch, ValueError("a bug"))
    assert res.exit_code not in (0, 2, 70)
    assert isinstance(res.exception, ValueError) and "internal error" not in res.output


def test_internal_error_from_the_console_script_is_one_line():
    code = ("from labkit.experiments import smoke\n"
            "def boom(*a, **k):\n    raise ValueError('a bug')\n"
            "smoke.run_smoke = boom\n"
            "from labkit.cli import main\n"
            "main(['smoke', '--out', '/dev/null'])\n")
    env = {k: v for k, v in os.environ.items() if k != "LABKIT_DEBUG"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 70 and "Traceback" not in res.stderr, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("internal error: ValueError: a bug"), res.stderr


@pytest.mark.parametrize("verdict,code", [("PASS", 0), ("REVIEW", 0), ("FAIL", 1), ("NOT-RUN", 2)])
def test_finish_exit_table(verdict, code):
    import typer

    from labkit.cli.app import finish

    record = {"verdict": verdict, "checkpoint": None, "facts": {},
              "checks": [{"name": "x", "passed": verdict == "PASS", "status": verdict.lower(), "why": "needs CUDA"}]}
    with pytest.raises(typer.Exit) as e:
        finish(record, json_out=True)
    assert e.value.exit_code == code


@pytest.mark.parametrize("verdicts,code", [(["PASS", "NOT-RUN"], 0), (["REVIEW", "NOT-RUN"], 0),
                                           (["PASS", "FAIL", "NOT-RUN"], 1), ([], 0)])
def test_finish_rows_exit_table(verdicts, code):
    import typer

    from labkit.cli.app import finish_rows

    with pytest.raises(typer.Exit) as e:
        finish_rows([{"id": f"c{i}", "verdict": v, "reason": ""} for i, v in enumerate(verdicts)], json_out=True)
    assert e.value.exit_code == code


def test_attention_backend_unavailable_is_a_user_error(tiny_model_dir, tmp_path, labkit_in_process):
    # the engine rejects it with a bare ValueError; the lab checks this user choice first
    one_clear_line(labkit_in_process("smoke", "--attention", "flash_attn", "--device", "cpu", "--model",
                                     str(tiny_model_dir), "--out", str(tmp_path / "s.json")), "not available")


# -- the newcomer's bad inputs, each one line and exit 2 -------------------------------------------------
def _truncated_copy(tiny_model_dir, tmp_path):
    import os
    import shutil

    bad = tmp_path / "truncated"
    shutil.copytree(tiny_model_dir, bad)
    weights = bad / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)       # an interrupted download
    return bad


def test_truncated_safetensors_is_a_user_error_not_an_internal_one(tiny_model_dir, tmp_path, labkit_in_process):
    res = labkit_in_process("smoke", "--model", str(_truncated_copy(tiny_model_dir, tmp_path)), "--device", "cpu",
                            "--out", str(tmp_path / "s.json"))
    assert res.returncode == 2, (res.returncode, res.stderr)                   # was 70, "internal error"
    one_clear_line(res, "model.safetensors is not a complete safetensors file")


def test_bench_unknown_workload_names_the_workload_not_the_cpu(labkit_in_process):
    res = labkit_in_process("bench", "--workload", "nosuch", "--device", "cpu")
    one_clear_line(res, "--workload nosuch: no such workload")
    assert res.returncode == 2 and "GPU" not in res.stderr and "latency" in res.stderr   # the workloads listed


@pytest.mark.parametrize("what", ["empty", "truncated", "missing"])
def test_run_with_a_bad_model_refuses_once_before_any_checkpoint(tiny_model_dir, tmp_path, labkit_in_process, what):
    model = {"empty": lambda: tmp_path / "empty", "missing": lambda: tmp_path / "nope",
             "truncated": lambda: _truncated_copy(tiny_model_dir, tmp_path)}[what]()
    if what == "empty":
        model.mkdir()
    res = labkit_in_process("run", "--model", str(model), "--stage", "setup")
    assert res.returncode == 2, res.stdout[-2000:]
    one_clear_line(res, str(model.name))
    assert "setup." not in res.stdout + res.stderr          # no checkpoint ran (each failed on its own before)


def test_hub_id_error_is_short_whole_words_and_names_an_installed_cli(tmp_path, monkeypatch):
    from labkit.assets import hub
    from labkit.assets.files import ModelError

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def unreachable(*a, local_files_only=False, **k):
        if local_files_only:
            raise FileNotFoundError("not cached")
        try:
            raise OSError("[Errno -2] Name or service not known")
        except OSError as inner:
            raise RuntimeError("An error happened while trying to locate the files on the Hub, and we cannot find "
                               "the appropriate snapshot folder for the specified revision on the local disk") from inner

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ModelError) as e:
        hub.resolve_hub_id("Org/Some-Model")
    msg = str(e.value)
    assert len(msg.replace(str(tmp_path / "hub"), "~/.cache/huggingface/hub")) <= 250 and "the hub cannot be reached" in msg and "cannot fi)" not in msg, msg
    import shutil

    for cli in ("huggingface-cli", "hf"):
        if f"`{cli} download" in msg:
            assert shutil.which(cli) or (Path(sys.executable).parent / cli).exists(), msg
    assert hub._reason(ValueError("word " * 40)).endswith(" ...")            # cut at a word, marked
    assert "wor ..." not in hub._reason(ValueError("word " * 40))


@pytest.mark.parametrize("message,flags,expected", [
    ("max_model_len must be a positive integer, got 0", {"--max-model-len"}, "--max-model-len must be a positive"),
    ("kvcache_block_size must be a power of two, got 3", {"--kv-cache-block-size"}, "--kv-cache-block-size must"),
    ("attention backend must be one of auto, flash_attn, triton, torch", {"--attention"}, "--attention must be one "
     "of auto, flash_attn, triton, torch"),
    ("temperature must be >= 0, got -1.0", {"--temperature"}, "--temperature must be >= 0"),
    ("max_model_len must be a positive integer, got 0", set(), "max_model_len must"),  # no such flag: left as is
])
def test_errors_name_the_commands_flags_not_config_fields(message, flags, expected):
    import importlib

    app_module = importlib.import_module("labkit.cli.app")
    assert app_module.as_flags(message, flags).startswith(expected)


def test_quick_walk_config_error_names_the_flag(tiny_model_dir, labkit_in_process):
    one_clear_line(labkit_in_process("quick-walk", "--case", "A", "--kv-cache-block-size", "3", "--model",
                                     str(tiny_model_dir)), "--kv-cache-block-size must be a power of two")


def _interrupt_smoke(monkeypatch, tmp_path):
    """smoke's experiment writes a file under runs/ and then gets Ctrl-C."""
    import labkit.experiments.smoke as smoke

    def interrupted(path, **kw):
        (tmp_path / "runs").mkdir(exist_ok=True)
        (tmp_path / "runs" / "partial.jsonl").write_text("{}\n")
        raise KeyboardInterrupt

    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))
    monkeypatch.setattr(smoke, "run_smoke", interrupted)


def test_ctrl_c_in_a_command_prints_one_interrupted_line_naming_what_is_left(monkeypatch, tmp_path, labkit_in_process):
    _interrupt_smoke(monkeypatch, tmp_path)
    res = labkit_in_process("smoke", "--out", str(tmp_path / "runs" / "s.json"))
    assert res.returncode == 130, (res.returncode, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "interrupted (Ctrl-C): labkit smoke stopped" in lines[0], res.stderr   # was silent
    assert "s.json not written" in lines[0] and "partial.jsonl" in lines[0], lines[0]


def test_a_closed_stdout_is_no_internal_error(monkeypatch, tmp_path, labkit_in_process):
    """`labkit model synth --help | head -3`: the reader left while the command wrote; it printed "internal error:
    BrokenPipeError" (exit 70). Now it stops without a word (141, as a shell reports SIGPIPE)."""
    import labkit.experiments.smoke as smoke

    def reader_gone(*a, **k):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(smoke, "run_smoke", reader_gone)
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))
    res = labkit_in_process("smoke")
    assert res.returncode == 141 and "internal error" not in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_evidence_files_follow_the_umask(tmp_path):
    from labkit.evidence import write_json
    from labkit.guardrails.suites import save_npz

    mask = os.umask(0o022)
    os.umask(mask)
    want = 0o666 & ~mask
    assert (write_json(tmp_path / "e.json", {"a": 1}).stat().st_mode & 0o777) == want       # was 0o600
    assert (save_npz(tmp_path / "a.npz", {"x": __import__("numpy").zeros(2)}).stat().st_mode & 0o777) == want


@pytest.mark.parametrize("argv,line", [
    (("smoke",), "labkit smoke: loading the model and building the engine"),
    (("model", "synth"), "labkit model synth: writing the model's weights and tokenizer"),
])
def test_slow_starts_say_what_they_do_first(monkeypatch, tmp_path, labkit_in_process, argv, line):
    import importlib

    import labkit.assets.synth as synth
    import labkit.experiments.smoke as smoke

    def stop(*a, **k):
        raise KeyboardInterrupt             # the status line is printed before the work; the work is not needed

    monkeypatch.setattr(smoke, "run_smoke", stop)
    monkeypatch.setattr(synth, "synth_model", stop)
    monkeypatch.setattr(importlib.import_module("labkit.cli.app"), "_status_wanted", lambda: True)   # a terminal
    monkeypatch.setenv("LABKIT_RUNS_DIR", str(tmp_path / "runs"))
    extra = ("--out", str(tmp_path / "m")) if argv == ("model", "synth") else ()
    res = labkit_in_process(*argv, *extra)
    assert res.stderr.splitlines()[0].startswith(line), res.stderr
    assert line not in labkit_in_process(*argv, *extra, "--help").stdout + labkit_in_process(*argv, *extra, "--help").stderr
