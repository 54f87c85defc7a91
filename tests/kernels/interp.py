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


def interpreted(script: str, *args: str, stdin: str | None = None, timeout: float = 600, interpret: bool = True) -> dict:
    """Run `script` (with args; stdin if given) under TRITON_INTERPRET=1 (interpret False: without it) from the
    repo root; its last stdout line as JSON. Skips the calling test where triton is absent or the script
    reports a skip."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]),
            **({"TRITON_INTERPRET": "1"} if interpret else {})}
    proc = subprocess.run([sys.executable, script, *args], input=stdin, capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    return out


def case_key(case) -> str:
    """A case tuple's name: the JSON key its interpreted result is printed under, and its pytest id."""
    return "-".join(map(str, case))


def print_results(one, cases, model=None) -> None:
    """In the interpreted process, its last line for the parent: ``model``'s result on the tiny model's directory
    where the test passed one (``model_results``), else each case's ``one(case)`` under its case_key."""
    if len(sys.argv) > 1:
        print(json.dumps(model(sys.argv[1])))
        return
    print(json.dumps({case_key(c): one(c) for c in cases}))


def once_per_launch(orig):
    """triton 3.6's interpreter patches triton.language again (inspect.getmembers over its modules) at every call
    of a jit function inside a kernel (tl.randint4x, a kernel's helpers): a quarter of an interpreted decode
    case's CPU. Within one launch the modules its kernel reaches are patched already and stay so until the launch
    restores them, so a device function that reaches no other module is not patched again; one that does is
    patched as before. The kernels and their numbers are the same."""
    import inspect

    import triton.language as tl

    active: set[int] = set()                        # the language modules patched in the running launch
    reaches: dict = {}                              # a function's language modules (its globals' modules)

    def patch(fn):
        langs = reaches.get(fn)
        if langs is None:
            langs = reaches[fn] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if active and langs <= active:
            return None                             # a device call: its return is not used
        scope = orig(fn)
        if not active:                              # a launch: it restores its scope once its grid has run
            restore = scope.restore

            def restore_and_forget():
                active.clear()
                restore()
            scope.restore = restore_and_forget
        active.update(langs)
        return scope
    return patch


def patch_interpreter() -> None:
    """In the interpreted process: triton 3.6's interpreter with test_decode_kernel_interp._index_fix and
    once_per_launch."""
    import triton.runtime.interpreter as interp
    from test_decode_kernel_interp import _index_fix

    interp._patch_lang_tensor = _index_fix(interp._patch_lang_tensor)
    interp._patch_lang = once_per_launch(interp._patch_lang)


def _trivial_kernel() -> None:
    """A kernel that cannot be wrong: x + 1 over 8 floats. Where it fails the interpreter itself cannot run here."""
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _add_one(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)

    x = torch.zeros(8)
    _add_one[(1,)](x, 8, BLOCK=8)
    assert x.tolist() == [1.0] * 8, x


def interpreter_ready(probe) -> bool:
    """In the interpreted process: patch triton 3.6's interpreter (patch_interpreter) and run a trivial kernel; where
    that fails, print {"skip": why} for the parent and return False. Then the test's own small case: a failure there
    is the kernel's (a bug, not the machine), so it is raised and the test fails."""
    patch_interpreter()
    try:
        _trivial_kernel()
    except Exception as e:                              # noqa: BLE001
        print(json.dumps({"skip": f"Triton's interpreter cannot run here: {type(e).__name__}: {str(e)[:160]}"}))
        return False
    probe()
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


def three_row_decode(model_dir: str):
    """In the interpreted process: the tiny model on the CPU (eager, its LM head narrowed) with three prompts
    prefilled, and the inputs of the decode step of those three sequences. -> (runner, inputs, the plain
    forward's logits in float32)."""
    from engine import LLMEngine, SamplingParams

    engine = LLMEngine(model_dir, device="cpu", enforce_eager=True, max_num_seqs=4, max_model_len=64,
                       num_kvcache_blocks=16, kvcache_block_size=16, max_num_batched_tokens=64)
    runner = engine.runner
    narrow_head(runner.model)
    for prompt in ([11, 12, 13], [21, 22, 23, 24, 25], [31, 32]):
        engine.add_request(prompt, SamplingParams(max_tokens=4))
    seqs, is_prefill = engine.schedule()
    engine.postprocess(seqs, runner.run(seqs, is_prefill)[0], is_prefill)            # the prompts' KV
    seqs, is_prefill = engine.schedule()                                              # one decode step, 3 rows
    assert not is_prefill and len(seqs) == 3
    inputs = runner.inputs.prepare(seqs, is_prefill)
    return runner, inputs, runner.run_model(inputs).float()


def tiny_triton_engine(model_dir: str, **flags):
    """In the interpreted process: the tiny model on the CPU (eager, 16-token pages) with the Triton backend (an SM
    count of 16: its CUDA constructor reads the device's) and every fused kernel on, its LM head narrowed; ``flags``
    set on each module that has the attribute (decode_prologue, decode_layer). Its runner's ``decode_logits``
    collects each decode step's logits."""
    from engine import LLMEngine
    from engine.attention.triton_backend import TritonAttention

    engine = LLMEngine(model_dir, device="cpu", enforce_eager=True, max_num_seqs=4, max_model_len=128,
                       num_kvcache_blocks=32, kvcache_block_size=16, max_num_batched_tokens=128)
    runner = engine.runner
    narrow_head(runner.model)
    backend = TritonAttention.__new__(TritonAttention)
    backend.sm_count = 16
    runner.backend = backend
    for layer in runner.model.attention_layers():
        layer.backend = backend
    for module in runner.model.modules():
        for name, value in {"fused": True, **flags}.items():
            if hasattr(module, name):
                setattr(module, name, value)
    runner.decode_logits = []
    run_model = runner.run_model

    def recorded(inputs, route=None):
        out = run_model(inputs, route)
        if not inputs.is_prefill:
            runner.decode_logits.append(out.float().clone())
        return out
    runner.run_model = recorded
    return engine
