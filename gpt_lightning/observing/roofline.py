"""This machine's measured ceiling, for `bench` and the benchmarks to print figures beside: a matmul's
FLOP/s in a dtype."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from gpt_lightning.observing.throughput import TF32

# Square matmul sizes timed: near each kind of device's peak, quick to time.
MATMUL_SIZES = {"cuda": (4096, 8192), "cpu": (512, 1024)}
# Each timed round runs the operation this long at least, so the clock and launch overhead do not count.
ROUND_SECONDS = 0.01


def _median_seconds(operation: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of one ``operation`` over ``repeats`` rounds of ``ROUND_SECONDS``, after a warm-up."""

    def sync() -> None:
        if device.type != "cpu":
            torch.accelerator.synchronize(device)

    def timed(count: int) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(count):
            operation()
        sync()
        return (time.perf_counter() - start) / count

    timed(1)
    count = max(1, math.ceil(ROUND_SECONDS / timed(1)))
    return statistics.median(timed(count) for _ in range(repeats))


def matmul_flops_per_sec(
    device: torch.device | str, dtype: torch.dtype | str, sizes: tuple[int, ...] | None = None, repeats: int = 5
) -> float:
    """FLOP/s of a square ``dtype`` matmul on ``device``: the best over ``sizes`` of the median of
    ``repeats`` rounds. ``TF32`` is a float32 matmul at "high" where the precision is "highest"."""
    device = torch.device(device)
    tf32 = dtype == TF32
    precision = torch.get_float32_matmul_precision()
    best = 0.0
    try:
        if tf32 and precision == "highest":
            torch.set_float32_matmul_precision("high")
        for n in sizes or MATMUL_SIZES.get(device.type, MATMUL_SIZES["cuda"]):
            a, b = (torch.randn(n, n, device=device, dtype=torch.float32 if tf32 else dtype) for _ in range(2))
            best = max(best, 2 * n**3 / _median_seconds(partial(torch.matmul, a, b), device, repeats))
    finally:
        torch.set_float32_matmul_precision(precision)
    return best
