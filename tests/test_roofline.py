"""The machine's ceilings that benchmarks report against: measured quickly, plausible, and leaving the
process's matmul settings as they were."""

import time

import pytest
import torch

from gpt_lightning.observing.roofline import matmul_flops_per_sec
from gpt_lightning.observing.throughput import TF32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, TF32])
def test_the_matmul_peak_is_measured_quickly_and_plausibly(dtype):
    before = torch.get_float32_matmul_precision()
    start = time.perf_counter()
    flops = matmul_flops_per_sec("cpu", dtype, sizes=(32, 64), repeats=2)
    assert time.perf_counter() - start < 2  # small sizes, ~10 ms rounds: a benchmark pays well under a second
    assert 1e7 < flops < 1e14  # a slow emulated bf16 core at 64^3 to far more than any CPU's peak
    assert torch.get_float32_matmul_precision() == before  # TF32's "high" only while measuring
