"""`labkit model check`: the handbook's look at the model before anything runs on it (5.1.5).

The handbook asks the learner to open Qwen3-0.6B's config and confirm it is the model the course is written for:
model_type qwen3, hidden size 1,024, 28 layers, 16 query heads, 8 KV heads, head_dim 128, bfloat16, rope_scaling
unchanged (none), and to print the tokenizer's class and length. This reads them (labkit.assets.identity.inspect_model)
into evidence (runs/setup-model-config.json); the checkpoint ``setup.model-config`` (checkpoints/setup.json) holds
the expected values as data and judges them.

The directory: ``--model`` when given (a learner's download, any model directory); else Qwen3-0.6B where
``labkit model download`` put it; else the lab's synthetic ``qwen3-0.6b`` preset, whose config.json is the real
model's (synthesized once into the lab's cache, as on a GPU). The evidence's model block says which it was and
whether it is synthetic.
"""
from __future__ import annotations

from pathlib import Path

CHECKPOINT = "setup.model-config"


def handbook_model(model: str | None = None):
    """The directory to check and where it came from (a labkit.assets.resolve.ModelRef)."""
    from labkit.assets.download import default_download_dir
    from labkit.assets.files import ModelError
    from labkit.assets.resolve import default_model, model_ref, resolve_model
    from labkit.assets.identity import validate_model_dir

    if model is not None and str(model).strip():
        return resolve_model(model, "cpu")
    downloaded = default_download_dir()
    if downloaded.is_dir():
        try:
            return model_ref(validate_model_dir(downloaded), "downloaded")
        except ModelError:
            pass                    # config and tokenizer only (no --weights), or an interrupted download
    return default_model("qwen3-0.6b")


def check_model_config(model: str | None = None, out: Path | None = None) -> dict:
    """Inspect the handbook's model directory and write the evidence ``setup.model-config`` judges; the record, with
    where it went under ``_paths``."""
    from labkit.assets.identity import inspect_model, model_identity
    from labkit.evidence import write_evidence
    from labkit.paths import default_out

    ref = handbook_model(model)
    info = inspect_model(ref.path)
    facts = {k: info[k] for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "dtype",
                                  "weights_dtype", "num_parameters", "tie_word_embeddings",
                                  "max_position_embeddings", "rope_theta", "rope_scaling", "tokenizer_class",
                                  "tokenizer_size")}
    facts["source"] = ref.source
    path = out or default_out("setup-model-config.json")
    record = write_evidence(path, checkpoint=CHECKPOINT, kind="static", facts=facts, device="cpu",
                            model={**model_identity(ref.path), "source": ref.source})
    record["_paths"] = {"json": record.get("_written_to", {}).get("path", str(path))}     # as write_claimed's
    return record
