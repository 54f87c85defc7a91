"""The models the engine runs: one registry (:mod:`engine.families`: config.json's architecture picks
the family, what differs is declared there) and one decoder (:mod:`engine.models.qwen3`) that every family
builds. :func:`build_model` is what the model runner calls."""
from __future__ import annotations

from engine.families import FAMILIES, ModelFamily, family_for, supported  # noqa: F401


def build_model(cfg: dict, backend, tp=None):
    """The causal LM of config.json ``cfg`` (its family from :func:`family_for`), on the default device and
    dtype of the caller, weights not loaded yet (engine/loader.py)."""
    from engine.distributed import SINGLE
    from engine.models.qwen3 import Qwen3ForCausalLM

    return Qwen3ForCausalLM(cfg, backend, SINGLE if tp is None else tp)
