"""Running a test module's Triton kernels on the CPU through Triton's interpreter: triton reads
TRITON_INTERPRET when triton.language is imported, so the kernels run in a fresh process (the module
itself, as a script) that prints one JSON line: its results, or {"skip": why} where the interpreter
cannot run here."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def interpreted(script: str, *args: str, stdin: str | None = None, timeout: float = 600) -> dict:
    """Run `script` (with args; stdin if given) under TRITON_INTERPRET=1 from the repo root; its last
    stdout line as JSON. Skips the calling test where triton is absent or the script reports a skip."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, script, *args], input=stdin, capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    return out


def interpreter_ready(probe) -> bool:
    """In the interpreted process: patch triton 3.6's interpreter (test_decode_kernel_interp._index_fix) and
    run one small case; where that fails, print {"skip": why} for the parent and return False."""
    import triton.runtime.interpreter as interp
    from test_decode_kernel_interp import _index_fix

    interp._patch_lang_tensor = _index_fix(interp._patch_lang_tensor)
    try:
        probe()
    except Exception as e:                              # noqa: BLE001
        print(json.dumps({"skip": f"Triton's interpreter cannot run here: {type(e).__name__}: {str(e)[:160]}"}))
        return False
    return True


#: The LM head rows the interpreted model cases keep: the tiny model's head is the real vocabulary's 151,936 rows,
#: 4,748 GEMV programs that the interpreter runs one after another (minutes); 16,400 rows keep the head's own
#: tile row (gemv_config: n >= 16384) and add a ragged last band, for a ninth of the programs.
HEAD_ROWS = 16_400


def narrow_head(model, rows: int = HEAD_ROWS) -> None:
    """In the interpreted process: give the model's LM head its first `rows` vocabulary rows (its own tensor, so a
    tied embedding keeps all of them); the plain and the fused forward both read the narrowed head."""
    import torch

    head = model.lm_head
    assert head.weight.shape[0] > rows, head.weight.shape
    head.weight = torch.nn.Parameter(head.weight[:rows].clone(), requires_grad=False)
