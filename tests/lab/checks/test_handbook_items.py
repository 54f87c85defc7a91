"""docs/HANDBOOK.md items whose parts nothing else asserted: each test below is what makes its item's status
true (the item names it). CPU; a stand-in hub where the real one cannot be reached."""
from __future__ import annotations

import importlib.metadata
import json
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


# --------------------------------------------------------------------------- 5.1.5: the pinned download (item 5)


class StandInHub:
    """huggingface_hub's two calls download_model makes, recorded; the snapshot writes the files a pattern asks
    for that the directory lacks (as huggingface_hub resumes: files already complete are not fetched again)."""

    FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")

    def __init__(self):
        self.calls: list[dict] = []

    def model_info(self, repo_id, revision=None, timeout=None):
        self.calls.append({"call": "model_info", "repo_id": repo_id, "revision": revision})

    def snapshot_download(self, repo_id, *, revision, local_dir, allow_patterns, **kw):
        import fnmatch

        fetched = []
        for name in self.FILES:
            path = Path(local_dir) / name
            if any(fnmatch.fnmatch(name, p) for p in allow_patterns) and not path.is_file():
                path.write_text("{}")
                fetched.append(name)
        self.calls.append({"call": "snapshot", "repo_id": repo_id, "revision": revision, "local_dir": local_dir,
                           "patterns": list(allow_patterns), "fetched": fetched})
        return local_dir


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub

    stand_in = StandInHub()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda endpoint=None: stand_in)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", stand_in.snapshot_download)
    return stand_in


def test_download_asks_for_the_pinned_revision_and_the_weights_and_resumes(hub, tmp_path):
    from labkit.assets import download

    out = tmp_path / "qwen3"
    download.download_model(out, weights=True)
    info, snap = hub.calls
    pinned = download.DEFAULT_REVISION
    assert len(pinned) == 40 and int(pinned, 16) >= 0                        # a commit, not a branch name
    assert (info["revision"], snap["revision"], snap["repo_id"]) == (pinned, pinned, "Qwen/Qwen3-0.6B")
    assert "*.safetensors" in snap["patterns"] and snap["local_dir"] == str(out.absolute())
    assert sorted(p.name for p in out.iterdir()) == sorted(StandInHub.FILES)

    (out / "model.safetensors").unlink()                                     # an interrupted download
    download.download_model(out, weights=True)
    assert hub.calls[-1]["fetched"] == ["model.safetensors"]                 # only what was missing
    assert (out / "config.json").is_file()

    download.download_model(tmp_path / "no-weights")                         # without --weights: no weights
    assert "*.safetensors" not in hub.calls[-1]["patterns"]
    assert not (tmp_path / "no-weights" / "model.safetensors").exists()


# --------------------------------------------------------------------------- 5.3.2: round mode (item 38)


@pytest.mark.parametrize("mode", ["round", "wall"])
def test_round_mode_evidence_says_it_explains_a_mechanism(mode, cli_app, tiny_model_dir, tmp_path):
    from typer.testing import CliRunner

    trace = tmp_path / "trace.jsonl"
    res = CliRunner().invoke(cli_app, ["trace", "--out", str(trace), "--requests", "3", "--prompt-tokens", "8",
                                       "--long-prompt-tokens", "16", "--long-every", "0", "--max-tokens", "3",
                                       "--interval-ms", "1"])
    assert res.exit_code == 0, res.output
    out = tmp_path / "load.jsonl"
    res = CliRunner().invoke(cli_app, ["load", "--trace", str(trace), "--mode", mode, "--warmup-requests", "0",
                                       "--model", str(tiny_model_dir), "--device", "cpu", "--out", str(out)])
    assert res.exit_code == 0, res.output
    (record,) = [json.loads(p.read_text()) for p in tmp_path.glob("load*.json")]
    note = record["facts"]["summary"]["note"]
    if mode == "round":
        assert note.startswith("round-mode replay") and "explains a mechanism, not a performance number" in note
    else:
        assert note is None


# --------------------------------------------------------------------------- 5.1.5: the config check (item 6)


def _with_config(src: Path, dst: Path, **changes) -> Path:
    """A copy of the model directory ``src`` whose config.json is Qwen3-0.6B's (the synth preset's, which is the
    real model's) with ``changes``: the check reads config.json and the tokenizer, not the weights."""
    import shutil

    from labkit.assets.synth import PRESETS

    shutil.copytree(src, dst)
    (dst / "config.json").write_text(json.dumps({**PRESETS["qwen3-0.6b"], **changes}, indent=2))
    return dst


def _failed(record: dict) -> list[str]:
    return sorted(c["name"] for c in record["checks"] if c["status"] == "fail")


def test_model_check_judges_the_handbook_config_and_fails_on_another(runs, tiny_model_dir, tmp_path, monkeypatch):
    """setup.model-config (checkpoints/setup.json): Qwen3-0.6B's config passes; the tiny model fails on each shape
    and the dtype; the same config with a rope_scaling block fails on that alone; `labkit check` re-judges it."""
    import sys

    from labkit.checks import check_evidence, get_checkpoint
    from labkit.experiments import model_config

    def check_model_config(model: str, out: Path) -> dict:        # as `labkit model check --model DIR` runs it
        monkeypatch.setattr(sys, "argv", ["labkit", "model", "check", "--model", model, "--out", str(out)])
        return model_config.check_model_config(model, out)

    qwen = _with_config(tiny_model_dir, tmp_path / "qwen3-0.6b")
    record = check_model_config(str(qwen), runs / "a.json")
    assert record["verdict"] == "PASS", _failed(record)
    assert record["facts"]["tokenizer_size"] == 151669 and record["facts"]["source"] == "flag"
    assert check_evidence(get_checkpoint("setup.model-config"), runs / "a.json")[0] == "PASS"
    tiny = check_model_config(str(tiny_model_dir), runs / "b.json")
    assert tiny["verdict"] == "FAIL" and _failed(tiny) == [
        "facts.dtype", "facts.head_dim", "facts.hidden_size", "facts.num_attention_heads",
        "facts.num_hidden_layers", "facts.num_key_value_heads"]
    yarn = _with_config(tiny_model_dir, tmp_path / "yarn",
                        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 10240})
    assert _failed(check_model_config(str(yarn), runs / "c.json")) == ["facts.rope_scaling"]


def test_model_check_takes_the_download_else_the_synthetic_preset(tiny_model_dir, tmp_path, monkeypatch):
    """Without --model: Qwen3-0.6B where `labkit model download` put it, when it is whole; else the lab's synthetic
    qwen3-0.6b (stood in here: synthesizing 0.6B takes half a minute)."""
    from labkit.assets import resolve
    from labkit.experiments.model_config import handbook_model

    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(resolve, "default_model", lambda preset: resolve.model_ref(tiny_model_dir, f"default:{preset}"))
    assert handbook_model(None).source == "default:qwen3-0.6b"
    (tmp_path / "cache" / "models" / "Qwen3-0.6B").mkdir(parents=True)        # config and tokenizer only: not whole
    assert handbook_model(None).source == "default:qwen3-0.6b"
    (tmp_path / "cache" / "models" / "Qwen3-0.6B").rmdir()
    _with_config(tiny_model_dir, tmp_path / "cache" / "models" / "Qwen3-0.6B")
    ref = handbook_model(None)
    assert (ref.source, ref.path) == ("downloaded", (tmp_path / "cache" / "models" / "Qwen3-0.6B").resolve())


# --------------------------------------------------------------------------- 5.7.2: the report's attachments (item 72)


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def test_report_attaches_the_engine_diff_the_head_and_the_installed_distributions(runs, tmp_path, monkeypatch):
    from labkit.writeup import report

    learner = tmp_path / "learner"
    (learner / "engine").mkdir(parents=True)
    (learner / "engine" / "scheduler.py").write_text("BUDGET = 512\n")
    _git(learner, "init", "-q")
    _git(learner, "-c", "user.email=l@x", "-c", "user.name=l", "add", "engine")
    _git(learner, "-c", "user.email=l@x", "-c", "user.name=l", "commit", "-qm", "engine")
    (learner / "engine" / "scheduler.py").write_text("BUDGET = 256\n")    # the learner's edit
    monkeypatch.setattr(report, "engine_dir", lambda: learner / "engine")

    def head() -> str:
        proc = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=REPO, capture_output=True, text=True)
        top, _, commit = proc.stdout.partition("\n")
        inside = proc.returncode == 0 and Path(top).resolve() == REPO.resolve()
        return commit.strip() if inside else "(not a git checkout)"

    before = head()
    report.write_final_report(runs / "final-report.json", plots=False)
    patch = (runs / "engine-changes.patch").read_text()
    assert patch == _git(learner, "diff", "HEAD", "--", "engine")
    assert "-BUDGET = 512" in patch and "+BUDGET = 256" in patch
    assert (runs / "source-head.txt").read_text().strip() in (before, head())     # HEAD may move in between
    listed = dict(line.split("==", 1) for line in (runs / "environment.txt").read_text().splitlines())
    lowered = {k.lower(): v for k, v in listed.items()}
    for name in ("torch", "transformers", "numpy", "typer"):
        assert lowered[name] == importlib.metadata.version(name), name
    assert len(listed) == len({d.metadata["Name"].lower() for d in importlib.metadata.distributions()
                               if d.metadata.get("Name")})
