"""labkit.assets: synthetic Qwen3 directories, validation, download errors, resolution."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from labkit.assets import download, identity, synth, tokenizer
from labkit.assets.download import download_model
from labkit.assets.files import SYNTH_FORMAT_VERSION, ModelError
from labkit.assets.identity import inspect_model, model_identity, validate_model_dir
from labkit.assets.resolve import ModelRef, default_model_name, resolve_model
from labkit.assets.synth import synth_model
from labkit.errors import UserError

TEXT = "The quick brown fox jumps over the lazy dog. 敏捷的棕色狐狸跳过了懒狗。 Hello, 世界!\n  code: x = 42"


def one_line(exc_info) -> str:
    msg = str(exc_info.value)
    assert msg and "\n" not in msg, repr(msg)
    return msg


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch):
    """LABKIT_CACHE in tmp_path, pre-seeded with the converted tokenizer (saves a rebuild)."""
    built = tokenizer.cached_tokenizer_json()
    cache = tmp_path / "cache"
    (cache / "tokenizer").mkdir(parents=True)
    shutil.copyfile(built, cache / "tokenizer" / built.name)
    monkeypatch.setenv("LABKIT_CACHE", str(cache))
    monkeypatch.delenv("MODEL_DIR", raising=False)
    return cache


# ------------------------------------------------------------------ the synthesized directory


def test_layout_and_config(tiny_model_dir):
    names = {p.name for p in tiny_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "labkit_synth.json"} <= names
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]) == (64, 2, 4, 2, 16, 128)
    assert cfg["vocab_size"] == 151936 and cfg["tie_word_embeddings"] is True
    assert cfg["dtype"] == "float32" and cfg["eos_token_id"] == 151645
    gen = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [151645, 151643]
    marker = json.loads((tiny_model_dir / "labkit_synth.json").read_text())
    assert marker["synthetic"] is True and marker["preset"] == "tiny" and marker["seed"] == 0
    assert "meaningless" in marker["note"]


def test_qwen3_06b_preset_has_the_real_shapes():
    cfg = synth.PRESETS["qwen3-0.6b"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]) == (1024, 28, 16, 8, 128, 3072, 151936)
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 1000000
    assert cfg["max_position_embeddings"] == 40960 and cfg["dtype"] == cfg["torch_dtype"] == "bfloat16"
    n = sum(eval("*".join(map(str, shape))) for _, shape, _, _ in synth._param_specs(cfg))
    assert n == 596_049_920  # Qwen3-0.6B's parameter count (tied embeddings)


def test_safetensors_names_follow_hf_qwen3(tiny_model_dir):
    from safetensors import safe_open

    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        emb = f.get_tensor("model.embed_tokens.weight")
    assert "lm_head.weight" not in keys
    assert len(keys) == 1 + 2 * 11 + 1
    for suffix in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj",
                   "mlp.down_proj", "input_layernorm", "post_attention_layernorm"):
        assert f"model.layers.1.{suffix}.weight" in keys
    assert tuple(emb.shape) == (151936, 64) and str(emb.dtype) == "torch.float32"


def test_transformers_loads_it_offline_and_logits_are_spread(tiny_model_dir, tok, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), local_files_only=True).eval()
    assert type(model).__name__ == "Qwen3ForCausalLM"
    ids = torch.tensor([tok.encode(TEXT)])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    assert out.logits.shape == (1, ids.shape[1], 151936)
    assert all(torch.isfinite(h).all() for h in out.hidden_states)
    assert torch.isfinite(out.logits).all()
    assert out.logits.std().item() > 1.0
    # positions see different contexts, so their distributions differ
    assert (out.logits[0, -1].argmax() != out.logits[0, -2].argmax()) or \
           (out.logits[0, -1] - out.logits[0, -2]).abs().max() > 0.5
    # greedy decoding does not just repeat one token
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=151643)
    assert len(set(gen[0, ids.shape[1]:].tolist())) > 2


# ------------------------------------------------------------------ tokenizer


def test_tokenizer_round_trip_and_special_ids(tok):
    assert type(tok).__name__.startswith("Qwen2Tokenizer")
    assert len(tok) == 151669
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    assert tok.convert_tokens_to_ids("<|im_end|>") == 151645
    assert tok.convert_tokens_to_ids("<|endoftext|>") == 151643
    for tid, content, _ in tokenizer.SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(content) == tid
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    assert tok.encode("Hello")[0] == 9707  # the real Qwen id of "Hello"
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[0] == 151644
    # <think> is an added token but not "special" in Qwen3: it survives skip_special_tokens
    both = tok.encode("<think>x</think><|im_end|>")
    assert tok.decode(both, skip_special_tokens=True) == "<think>x</think>"


def test_tokenizer_ids_match_tiktoken(tok):
    import tiktoken

    ranks = tokenizer._load_tiktoken_ranks(tokenizer._tiktoken_file())
    assert len(ranks) == 151643 and max(ranks.values()) == 151642
    enc = tiktoken.Encoding("qwen-test", pat_str=tokenizer.QWEN_SPLIT_REGEX, mergeable_ranks=ranks, special_tokens={})
    for text in (TEXT, "人工智能正在改变世界，machine learning isn't magic! 🚀🚀 \t\n\n  def f(x):\n    return x**2"):
        assert tok.encode(text) == enc.encode_ordinary(text)


def test_chat_template_with_and_without_thinking(tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    base = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    assert tok.apply_chat_template(msgs, tokenize=False) == base
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        base + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True) == \
        base + "<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False) == \
        base + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # earlier assistant turns lose their reasoning, like Qwen3's template
    multi = msgs + [{"role": "assistant", "content": "<think>\nhmm\n</think>\n\nHello!"},
                    {"role": "user", "content": "Again"}]
    assert tok.apply_chat_template(multi, tokenize=False) == \
        base + "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n"
    ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == 151644 and ids.count(151645) == 2


def test_tokenizer_json_is_cached_by_tiktoken_sha(tiny_model_dir):
    cached = tokenizer.cached_tokenizer_json()
    digest = hashlib.sha256(tokenizer._tiktoken_file().read_bytes()).hexdigest()
    assert digest[:24] in cached.name
    assert cached.read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    merges = json.loads(cached.read_text())["model"]["merges"]
    assert len(merges) == 151643 - 256


# ------------------------------------------------------------------ synth options and determinism


def test_same_seed_same_bytes_other_seed_differs(tiny_model_dir, tmp_path):
    again = synth_model("tiny", tmp_path / "again", seed=0)
    other = synth_model("tiny", tmp_path / "other", seed=1)
    a = model_identity(tiny_model_dir)
    assert model_identity(again)["weights_sha256"] == a["weights_sha256"]
    assert model_identity(again)["config_sha256"] == a["config_sha256"]
    assert model_identity(other)["weights_sha256"] != a["weights_sha256"]
    assert model_identity(other)["seed"] == 1


def test_synth_refuses_non_empty_dir_unless_forced(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ModelError) as e:
        synth_model("tiny", out)
    assert "--force" in one_line(e)
    path = synth_model("tiny", out, force=True, dtype="bfloat16")
    assert (path / "notes.txt").read_text() == "mine"  # unrelated files are left alone
    validate_model_dir(path)
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    assert inspect_model(path)["weights_dtype"] == "bfloat16"
    # an existing empty directory is fine without force
    (tmp_path / "empty").mkdir()
    validate_model_dir(synth_model("tiny", tmp_path / "empty"))


def test_synth_rejects_unknown_preset_and_dtype(tmp_path):
    with pytest.raises(ModelError) as e:
        synth_model("qwen3-72b", tmp_path / "x")
    msg = one_line(e)
    assert "tiny" in msg and "qwen3-0.6b" in msg
    with pytest.raises(ModelError):
        synth_model("tiny", tmp_path / "y", dtype="int8")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_interrupted_synth_leaves_no_directory(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(synth, "_make_weights", boom)
    with pytest.raises(KeyboardInterrupt):
        synth_model("tiny", tmp_path / "half")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ inspect / identity


def test_inspect_model_fields(tiny_model_dir):
    info = inspect_model(tiny_model_dir)
    expected = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 151936,
                "dtype": "float32", "tie_word_embeddings": True, "tokenizer_size": 151669,
                "synthetic": True, "preset": "tiny", "path": str(tiny_model_dir)}
    assert {k: info[k] for k in expected} == expected
    assert info["tokenizer_class"].startswith("Qwen2Tokenizer")
    assert info["config_sha256"] == hashlib.sha256((tiny_model_dir / "config.json").read_bytes()).hexdigest()
    assert info["weights_sha256"] == hashlib.sha256((tiny_model_dir / "model.safetensors").read_bytes()).hexdigest()
    attn = 2 * (4 * 16) * 64 + 2 * (2 * 16) * 64           # q,o + k,v
    per_layer = attn + 3 * 64 * 128 + 2 * 16 + 2 * 64        # + mlp + q/k norms + layer norms
    assert info["num_parameters"] == 151936 * 64 + 2 * per_layer + 64


def test_model_identity_caches_and_notices_changes(tiny_model_dir, tmp_path, monkeypatch):
    d = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, d)
    monkeypatch.setenv("LABKIT_CACHE", str(tmp_path / "cache"))
    ident = model_identity(d)
    assert set(ident) == {"path", "config_sha256", "weights_sha256", "synthetic", "preset", "seed", "init"}
    assert (ident["synthetic"], ident["preset"], ident["seed"], ident["init"]) == (True, "tiny", 0, "random")
    assert ident["weights_sha256"] == model_identity(tiny_model_dir)["weights_sha256"]
    # second call: served from the cache, no hashing of the weights
    calls = []
    real = identity.sha256_file
    monkeypatch.setattr(identity, "sha256_file", lambda p, h=None: (calls.append(Path(p).name), real(p, h))[1])
    assert model_identity(d) == ident
    assert "model.safetensors" not in calls
    # the on-disk cache survives a new process (simulated by clearing the in-memory one)
    identity._HASH_CACHE.clear()
    assert model_identity(d) == ident and "model.safetensors" not in calls
    # changing the weights changes the fingerprint
    with open(d / "model.safetensors", "r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x00\x01\x02\x03")
    os.utime(d / "model.safetensors", ns=(time.time_ns(), time.time_ns() + 10**9))
    assert model_identity(d)["weights_sha256"] != ident["weights_sha256"]
    # without the marker the directory is not synthetic
    (d / "labkit_synth.json").unlink()
    assert model_identity(d)["synthetic"] is False and model_identity(d)["preset"] is None


# ------------------------------------------------------------------ validation errors


def _broken(tiny_model_dir, tmp_path) -> Path:
    d = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, d)
    return d


def test_validate_missing_and_not_a_dir(tmp_path):
    with pytest.raises(ModelError) as e:
        validate_model_dir(tmp_path / "nope")
    assert "not found" in one_line(e) and str(tmp_path / "nope") in str(e.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelError) as e:
        validate_model_dir(tmp_path / "file")
    assert "not a directory" in one_line(e)
    assert issubclass(ModelError, UserError)


@pytest.mark.parametrize("damage, words", [
    (lambda d: (d / "config.json").unlink(), "config.json is missing"),
    (lambda d: (d / "config.json").write_text('{"model_type": "qwen3",\n  oops'), "not valid JSON"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), "expected a JSON object"),
    (lambda d: (d / "config.json").write_text('{"model_type": "mistral"}'),
     "model_type 'mistral' in config.json is not supported (supported: LlamaForCausalLM (llama)"),
    (lambda d: (d / "config.json").write_text('{"model_type": "qwen3"}'), "missing or non-integer"),
    (lambda d: (d / "model.safetensors").unlink(), "no *.safetensors"),
    (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer.json"),
])
def test_validate_malformed_dirs(tiny_model_dir, tmp_path, damage, words):
    d = _broken(tiny_model_dir, tmp_path)
    damage(d)
    with pytest.raises(ModelError) as e:
        validate_model_dir(d)
    assert words in one_line(e)
    with pytest.raises(ModelError):
        inspect_model(d)


# ------------------------------------------------------------------ download (offline)


def test_download_offline_fails_fast_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    with pytest.raises(ModelError) as e:
        download_model(tmp_path / "dl")
    msg = one_line(e)
    assert "Qwen/Qwen3-0.6B@" + download.DEFAULT_REVISION in msg and "--model DIR" in msg
    assert time.monotonic() - t0 < 5


def test_download_unreachable_endpoint_fails_fast(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # loopback, nothing listens
    t0 = time.monotonic()
    with pytest.raises(ModelError) as e:
        download_model(tmp_path / "dl", weights=True)
    msg = one_line(e)
    assert msg.startswith("cannot reach the Hugging Face hub to download Qwen/Qwen3-0.6B@")
    assert time.monotonic() - t0 < 20
    assert not (tmp_path / "dl").exists()


# ------------------------------------------------------------------ resolve_model


def test_resolve_flag_beats_env_beats_default(tiny_model_dir, tmp_path, isolated_cache, monkeypatch):
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dir, other)
    monkeypatch.setenv("MODEL_DIR", str(other))
    ref = resolve_model(str(tiny_model_dir), "cpu")
    assert isinstance(ref, ModelRef)
    assert (ref.path, ref.source, ref.synthetic, ref.preset) == (tiny_model_dir, "flag", True, "tiny")
    ref = resolve_model(None, "cpu")
    assert (ref.path, ref.source) == (other.resolve(), "env")
    monkeypatch.setenv("MODEL_DIR", str(tmp_path / "missing"))
    with pytest.raises(ModelError) as e:
        resolve_model(None, "cpu")
    assert "MODEL_DIR" in one_line(e)
    with pytest.raises(ModelError):
        resolve_model(str(tmp_path / "missing"), "cpu")
    assert not (isolated_cache / "models").exists()  # nothing synthesized so far


def test_resolve_default_synthesizes_once_and_reuses(isolated_cache, monkeypatch):
    ref = resolve_model(None, "cpu")
    assert ref.source == "default" and ref.synthetic and ref.preset == "tiny"
    assert ref.path == (isolated_cache / "models" / default_model_name("tiny")).resolve()
    stamp = (ref.path / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("", "cpu").path == ref.path
    assert (ref.path / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert [p.name for p in (isolated_cache / "models").iterdir()] == [default_model_name("tiny")]  # no temp leftovers
    # a damaged default is rebuilt
    (ref.path / "tokenizer.json").unlink()
    assert validate_model_dir(resolve_model(None, "cpu").path) == ref.path


def test_resolve_default_on_cuda_uses_the_06b_preset(isolated_cache, monkeypatch):
    # keep the test fast: the 0.6b preset is swapped for tiny shapes, only the name matters here
    monkeypatch.setitem(synth.PRESETS, "qwen3-0.6b", synth.PRESETS["tiny"])
    ref = resolve_model(None, "cuda:0")
    assert (ref.source, ref.preset) == ("default", "qwen3-0.6b")
    assert ref.path.name == default_model_name("qwen3-0.6b") == f"qwen3-0.6b-seed0-v{SYNTH_FORMAT_VERSION}"


def _fake_hf_cache(root, repo_id: str, model_dir) -> "Path":
    """A Hugging Face cache (HF_HOME layout) holding ``model_dir`` as ``repo_id``'s snapshot at ref main."""
    entry = root / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = entry / "snapshots" / "0123abcd"
    shutil.copytree(model_dir, snap)
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text("0123abcd")
    return snap


def test_a_hub_id_resolves_from_the_local_hf_cache(tiny_model_dir, tmp_path, monkeypatch):
    """The `serve Qwen/Qwen3-0.6B` habit: an org/name that is no path comes from the HF cache;
    an existing directory of that name still wins. Nothing is downloaded (HF_HUB_OFFLINE)."""
    snap = _fake_hf_cache(tmp_path / "hf", "acme/tiny-qwen3", tiny_model_dir)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    ref = resolve_model("acme/tiny-qwen3", "cpu")
    assert (ref.path, ref.source, ref.preset) == (snap.resolve(), "hub", "tiny")
    local = tmp_path / "acme" / "tiny-qwen3"
    shutil.copytree(tiny_model_dir, local)
    assert resolve_model("acme/tiny-qwen3", "cpu").path == local.resolve()


def test_serve_a_hub_id_not_cached_offline_is_one_line_naming_model_download(tmp_path, monkeypatch):
    """`labkit serve ORG/NAME` (the command's own function, as the CLI calls it) with the id not cached and
    HF_HUB_OFFLINE=1: one UserError line (exit 2, `error:`) naming how to get it: the installed hub CLI's
    `download ORG/NAME` (labkit.assets.hub.download_hint), else `labkit model download`."""
    from labkit.cli.service import serve
    from labkit.errors import UserError

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as got:
        serve("acme/not-cached", port=0, device="cpu", event_log=False, log_level="warning")
    text = str(got.value)
    assert "\n" not in text and "acme/not-cached" in text, text
    assert "download acme/not-cached`" in text or "labkit model download" in text, text
