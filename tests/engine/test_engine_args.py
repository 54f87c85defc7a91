"""Engine options declared once: every option and its default in engine/args.py's EngineArgs, read by Config
without a copy, and no other class in engine/ or labkit/ declaring a default of its own for one."""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from engine import Config, ConfigError, EngineArgs
from engine.args import OPTION_NAMES
from engine.config import DERIVED

ROOT = Path(__file__).resolve().parents[2]
#: Same name, another thing: not an engine option (each with what it is).
OTHER_MEANING = {
    "ParallelContext.device": "one TP rank's torch device",
    "SamplingParams.seed": "a request's sampling seed (vLLM's SamplingParams.seed)",
    "TraceOptions.seed": "the trace generator's seed",
    "WorkloadOptions.seed": "the workload generator's seed",
    "GenRequest.model": "the served model name a request names (OpenAI's model field)",
    "Suite.max_model_len": "a guardrail suite's own choice of the option, lab data like engine/args.py's PRESETS",
}


def stray_defaults(root: Path = ROOT) -> list[str]:
    """Class-level ``name: type = <literal>`` for an engine option anywhere in engine/ or labkit/ outside
    engine/args.py (a default read from ``DEFAULTS.<name>`` is not a literal and passes)."""
    found = []
    for path in sorted((root / "engine").rglob("*.py")) + sorted((root / "labkit").rglob("*.py")):
        if path == root / "engine" / "args.py":
            continue
        for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
            for st in cls.body:
                if (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)
                        and st.target.id in OPTION_NAMES and st.value is not None
                        and not isinstance(st.value, (ast.Attribute, ast.Name))
                        and f"{cls.name}.{st.target.id}" not in OTHER_MEANING):
                    found.append(f"{path.relative_to(root)}:{st.lineno} {cls.name}.{st.target.id}")
    return found


def test_every_option_is_declared_once_and_config_copies_none(tiny_model_dir):
    assert stray_defaults() == []
    cfg = Config(EngineArgs(str(tiny_model_dir), max_num_seqs=3, max_model_len=10 ** 6))
    for name in OPTION_NAMES:
        if name in DERIVED:                 # the two Config works out from the model directory
            assert name in vars(cfg)
        else:                               # read through from args: no copy in the instance
            assert name not in vars(cfg) and getattr(cfg, name) == getattr(cfg.args, name)
    assert cfg.max_num_seqs == cfg.scheduler_limits().max_num_seqs == 3
    assert cfg.max_model_len == cfg.shape.max_position_embeddings < cfg.args.max_model_len
    limits = cfg.scheduler_limits()
    assert cfg.summary()["max_num_seqs"] == 3 and limits.max_model_len == cfg.max_model_len


def test_the_scan_finds_a_stray_default(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "labkit").mkdir()
    (tmp_path / "labkit" / "knobs.py").write_text("class Knobs:\n    max_num_seqs: int = 8\n"
                                                  "    read: int = DEFAULTS.max_num_seqs\n")
    assert stray_defaults(tmp_path) == ["labkit/knobs.py:2 Knobs.max_num_seqs"]


def test_plain_values_are_judged_at_construction():
    for bad, says in (({"max_num_seqs": 0}, "max_num_seqs must be a positive integer"),
                      ({"kvcache_block_size": 24}, "power of two"),
                      ({"max_model_len": "fit"}, '"auto"'),
                      ({"overlap": True, "tensor_parallel_size": 2}, "overlap needs tensor_parallel_size 1")):
        with pytest.raises(ConfigError, match=says):
            EngineArgs(**bad)
    assert EngineArgs(graph_buckets=(4, 1, 4)).graph_buckets == (1, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineArgs().max_num_seqs = 3
