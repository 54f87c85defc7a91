"""Errors a user can cause end in one clear line and a non-zero exit, never a traceback (issue 2)."""
import os
import subprocess
import sys

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
    one_clear_line(labkit("quick-walk", "--case", "A", "--model", str(tmp_path / "nope")), "nope")


def test_malformed_model_dir(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    one_clear_line(labkit("smoke", "--model", str(bad)), "config.json")


def test_block_size_not_power_of_two(tiny_model_dir):
    one_clear_line(labkit("quick-walk", "--case", "A", "--block-size", "3", "--model", str(tiny_model_dir)),
                   "power of two")


def test_token_id_outside_vocabulary(tiny_model_dir, tmp_path):
    one_clear_line(labkit("generate", "--token-ids", "1,2,999999", "--model", str(tiny_model_dir),
                          "--out", str(tmp_path / "g.json")), "outside the vocabulary")


def test_prompt_longer_than_max_model_len(tiny_model_dir, tmp_path):
    ids = ",".join(str(i) for i in range(100, 400))
    one_clear_line(labkit("generate", "--token-ids", ids, "--max-model-len", "128", "--model", str(tiny_model_dir),
                          "--out", str(tmp_path / "g.json")), "max_model_len")


def test_unknown_case_is_a_usage_error_without_traceback(tiny_model_dir):
    res = labkit("quick-walk", "--case", "E", "--model", str(tiny_model_dir))
    assert res.returncode == 2 and "Traceback" not in res.stdout + res.stderr
    assert "'e' is not one of" in res.stderr or "is not one of" in res.stderr


@pytest.mark.parametrize("args,needle", [
    (("--max-tokens", "0"), "max_tokens"),
    (("--temperature", "-1"), "temperature"),
])
def test_bad_sampling_params(tiny_model_dir, tmp_path, args, needle):
    one_clear_line(labkit("generate", "--token-ids", "1,2", *args, "--model", str(tiny_model_dir),
                          "--out", str(tmp_path / "g.json")), needle)


def test_generate_works_and_says_synthetic(tiny_model_dir, tmp_path):
    res = labkit("generate", "--prompt", "Hello", "--chat", "--max-tokens", "3", "--ignore-eos",
                 "--model", str(tiny_model_dir), "--out", str(tmp_path / "g.json"))
    assert res.returncode == 0, res.stderr
    assert "synthetic" in res.stdout + res.stderr and (tmp_path / "g.json").is_file()


def test_quick_walk_debug_stops_in_pdb_after_init_then_continues(tiny_model_dir, tmp_path):
    e = dict(os.environ)
    res = subprocess.run([sys.executable, "-m", "labkit", "quick-walk", "--case", "A", "--trace", "--debug", "--model",
                          str(tiny_model_dir), "--out", str(tmp_path / "a.json")],
                         input="p type(engine).__name__, len(engine.scheduler.waiting), engine.block_manager.num_blocks\nc\n",
                         capture_output=True, text=True, env=e, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "(Pdb)" in res.stdout and "('LLMEngine', 0," in res.stdout    # engine built, no request added yet
    assert "PASS" in res.stdout
