"""The engine pins Triton's FP fusion on (the default its kernels were measured and tested under, which Triton
3.10 turns off) unless the environment already says otherwise."""
from __future__ import annotations

import os
import subprocess
import sys


def _fusion_after_import(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_DEFAULT_FP_FUSION"}
    if env_value is not None:
        env["TRITON_DEFAULT_FP_FUSION"] = env_value
    code = "import os, engine; print(os.environ.get('TRITON_DEFAULT_FP_FUSION'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_importing_the_engine_keeps_triton_fp_fusion_on():
    assert _fusion_after_import(None) == "1"


def test_a_value_set_outside_the_engine_wins():
    assert _fusion_after_import("0") == "0"
