"""The attention bench's kernel timing (labkit.bench.timing.kernel_ms) on a GPU: what it brackets."""
import time

import pytest
import torch

from labkit.bench.timing import kernel_ms, time_ms

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_kernel_ms_leaves_out_the_host_launch_path():
    x = torch.zeros(1024, device="cuda")

    def call():
        time.sleep(0.003)              # a host path far longer than the kernel it launches
        x.add_(1)

    assert time_ms(call, repeats=5, warmups=1) >= 2.5      # one eager call between events measures the host
    assert kernel_ms(call, repeats=5, warmups=1) < 0.5     # behind the spin kernel only the add is between them
