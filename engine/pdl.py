"""Programmatic dependent launch (PDL): a step's Triton kernels overlap their start with the tail of the one before.

Without it every kernel on a stream starts only when the previous one has finished: at batch-1 decode a step is
some 170 small kernels, and each pays its launch and its first loads while the GPU sits idle between them. With
PDL (Hopper and later) a kernel launched with the attribute may start while its predecessor still runs. Each of
our kernels then keeps one rule, in every program (``enter(PDL)`` below is steps 2 and 3):

1. do only what depends on no earlier kernel (address arithmetic; loading weights and tables, which never change
   in a step; and, in the decode kernels that say so, the step's inputs: positions, slots, context lengths and
   block tables, copied in before the step's first kernel, which has finished by the time the kernel two after
   it starts);
2. ``gdc_wait()``: block until the previous kernel has finished and its writes are visible;
3. ``gdc_launch_dependents()``: let the next kernel start its own step 1;
4. everything else: loads of activations, every store. No program returns before step 2.

Because every PDL kernel waits before it ends, "the previous kernel finished" implies that every earlier one did,
so the chain stays ordered like a plain stream. Kernels we do not launch (cuBLAS, torch) are launched without
the attribute and wait for everything before them, as always. Inside a CUDA graph the launches are captured as
programmatic edges. Off on CPU (the interpreter has no grid dependency control) and before compute capability 9.
The switch is per device and process (the last engine built there sets it; graphs already captured keep theirs).
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:     # a CPU install without the cuda extra: no kernel of ours is compiled, none calls enter()
    triton = None

if triton is not None:
    @triton.jit
    def enter(PDL: tl.constexpr):
        """Steps 2 and 3 of the rule above, in every PDL kernel's programs (nothing when PDL is off)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

_on: set[int] = set()        # CUDA device indices whose kernels launch with PDL


def enable(device: str | torch.device, on: bool = True) -> bool:
    """Turn PDL on (or off) for our kernels on a CUDA ``device``; returns whether it is on (capability >= 9)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return False
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    on = on and torch.cuda.get_device_capability(index)[0] >= 9
    (_on.add if on else _on.discard)(index)
    return on


def launch(t: torch.Tensor) -> dict:
    """The launch keywords of a kernel whose tensors live with ``t``: PDL's constexpr and launch flag where it is
    on for that device, else none (the kernel's ``PDL`` default is False)."""
    if _on and t.is_cuda and t.device.index in _on:
        return {"PDL": True, "launch_pdl": True}
    return {}
