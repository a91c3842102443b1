"""``ThroughputMonitor``: post-warm-up tokens/sec, step time and MFU, for any LightningModule,
without Lightning's per-batch device sync (docs/throughput.md)."""

from __future__ import annotations

import json
import platform
import re
import resource
import statistics
import time
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.fabric.utilities.throughput import get_available_flops
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from gpt_lightning.atomic import atomic_write_bytes
from gpt_lightning.precision import matmul_dtype

# Dense tensor-core peaks (bf16/fp16, tf32) FLOP/s from NVIDIA's datasheets and whitepapers, read before
# Lightning's table (which lacks some and gives sparse or shader rates for others). A row matches when all
# its words are words of the device name; the first match wins.
_DENSE_PEAKS: tuple[tuple[tuple[str, ...], float, float], ...] = (
    (("gb200",), 2.5e15, 1.25e15),
    (("b200",), 2.25e15, 1.1e15),
    (("gh200",), 989.4e12, 494.7e12),
    (("h200", "nvl"), 835e12, 417.5e12),
    (("h200",), 989.4e12, 494.7e12),
    (("h100", "nvl"), 835e12, 417.5e12),
    (("h100", "pcie"), 756e12, 378e12),
    (("h100",), 989.4e12, 494.7e12),
    (("h800", "pcie"), 756e12, 378e12),
    (("h800",), 989.4e12, 494.7e12),
    (("a100",), 312e12, 156e12),
    (("a800",), 312e12, 156e12),
    (("l40s",), 362.05e12, 183e12),
    (("l40",), 181.05e12, 90.5e12),
    (("l4",), 121e12, 60e12),
    (("a10g",), 125e12, 62.5e12),
    (("a10",), 125e12, 62.5e12),
    (("rtx", "6000", "ada"), 364.2e12, 182.1e12),
    (("rtx", "4090"), 165.2e12, 82.6e12),
    (("rtx", "5090"), 209.5e12, 104.8e12),
    (("rtx", "a6000"), 154.8e12, 77.4e12),
    (("rtx", "3090"), 71e12, 35.6e12),
)
# Without step logging, pending step marks are resolved every this many steps instead of piling up.
_MAX_PENDING = 1000
# How Lightning's FLOPs table spells TF32.
TF32 = "tfloat32"


def dense_peak_flops(device_name: str, dtype: torch.dtype | str) -> float | None:
    """Peak dense FLOP/s at bf16, fp16 or TF32 for a device name in ``_DENSE_PEAKS``, else None."""
    words = set(re.split(r"[^a-z0-9]+", device_name.lower()))
    for keys, half, tf32 in _DENSE_PEAKS:
        if all(key in words for key in keys):
            return {torch.bfloat16: half, torch.float16: half, TF32: tf32}.get(dtype)
    return None


def precision_dtype(precision: str) -> torch.dtype | str:
    """The matmul dtype of a Lightning precision string, as ``get_available_flops`` takes it (``"tfloat32"``
    where ``float32_matmul_precision`` lets float32 matmuls use TF32)."""
    dtype = matmul_dtype(precision) or torch.float32  # transformer-engine's: float32's
    return TF32 if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest" else dtype


def peak_flops_for(device: torch.device, precision: str) -> float | None:
    """Peak FLOP/s of ``device`` at ``precision``, or None when not known (CPUs, unknown GPUs)."""
    if device.type != "cuda":
        return None
    dtype = precision_dtype(precision)
    name = torch.cuda.get_device_name(device)
    ours = dense_peak_flops(name, dtype)
    if ours is not None:
        return ours
    with warnings.catch_warnings():  # Lightning warns "FLOPs not found"; the line below says what to do
        warnings.simplefilter("ignore")
        theirs = get_available_flops(device, dtype)
    if theirs:
        return float(theirs)
    rank_zero_info(
        f"No MFU: the peak {dtype} FLOP/s of {name!r} is not in gpt-lightning's table. Give one device's dense "
        "peak in FLOP/s (its datasheet's figure without sparsity), e.g. --throughput.peak_flops 312e12."
    )
    return None


def _count_tokens(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, dict):
        batch = batch.get("input_ids", next(iter(batch.values())))
        return _count_tokens(batch)
    if isinstance(batch, (list, tuple)) and batch:
        return _count_tokens(batch[0])
    raise TypeError(f"ThroughputMonitor cannot count tokens in a batch of type {type(batch).__name__}.")


def _deciles(values: list[float]) -> tuple[float, float]:
    """The 10th and 90th percentiles, linearly interpolated between data points (numpy's default)."""
    if len(values) == 1:  # statistics.quantiles needs two points before Python 3.13
        return values[0], values[0]
    deciles = statistics.quantiles(values, n=10, method="inclusive")
    return deciles[0], deciles[-1]


def _summed_over_ranks(
    trainer: Trainer, pl_module: LightningModule, values: list, dtype: torch.dtype | None = None
) -> list:
    """``values``, each summed over the ranks in one collective."""
    return trainer.strategy.reduce(torch.tensor(values, dtype=dtype, device=pl_module.device), reduce_op="sum").tolist()


@dataclass
class StepTiming:
    index: int  # optimizer steps since this fit started (0 = the first, compiling step)
    seconds: float
    tokens: int  # tokens this process consumed in the step (all micro-batches)


class ThroughputMonitor(Callback):
    """Post-warm-up tokens/sec, step time and MFU, logged under ``throughput/``; validation,
    checkpoints and evaluation passes are not counted. ``fit`` ends with a summary line and a JSON file.

    Args:
        warmup_steps: optimizer steps from the start of each ``fit`` (compiling, autotuning) left out
            of the statistics.
        peak_flops: peak FLOP/s of one device for MFU. None: looked up; on CPUs and unknown devices no MFU.
        flops_per_batch: training FLOPs of one micro-batch. None: the module's ``training_flops(batch_size,
            seq_len)`` or ``flops_per_batch``; without either, no MFU.
        filename: name of the JSON summary written into ``trainer.log_dir`` (None: not written).
    """

    def __init__(
        self,
        warmup_steps: int = 10,
        peak_flops: float | None = None,
        flops_per_batch: float | None = None,
        filename: str | None = "throughput.json",
    ) -> None:
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}.")
        self.warmup_steps = warmup_steps
        self.peak_flops = peak_flops
        self.flops_per_batch = flops_per_batch
        self.filename = filename
        self.summary: dict[str, Any] | None = None
        self._step_start: Any = None  # the rest is set at on_train_start; a sanity check may pause before it
        self._step_index = 0

    @staticmethod
    def _now() -> float:
        return time.perf_counter()

    def _mark(self) -> Any:
        if self._use_events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self._now()

    def _seconds(self, start: Any, end: Any) -> float:
        if self._use_events:
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        return end - start

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._use_events = pl_module.device.type == "cuda"
        self.steps: list[StepTiming] = []
        # (index, (start, end) marks, tokens, seconds of HellaSwag passes inside those marks)
        self._pending: list[tuple[int, list[tuple[Any, Any]], int, float]] = []
        self._step_index = 0
        self._step_tokens = 0
        self._tokens_per_step: Counter[int] = Counter()  # this rank's tokens of a step -> steps that trained so many
        self._step_start: Any = None  # mark at which the step's clock last started; None while paused
        self._step_spans: list[tuple[Any, Any]] = []  # (start, end) marks of the step's time before a pause
        self._evaluators = [
            callback for callback in trainer.callbacks if isinstance(getattr(callback, "durations", None), list)
        ]
        self._passes_seen: list[int] = []  # each evaluator's passes when the clock last started
        self._step_evaluating = 0.0  # seconds of the passes inside the step's spans so far
        self._last_global_step = trainer.global_step
        self._flops_per_token: float | None = None
        self._peak = self.peak_flops or peak_flops_for(pl_module.device, str(trainer.precision))
        self.summary = None
        if self._use_events:
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._step_start is None:  # first micro-batch after start, validation or a checkpoint: the clock goes on
            self._start_clock(self._mark())
        tokens = _count_tokens(batch)
        self._step_tokens += tokens
        if self._flops_per_token is None:
            self._flops_per_token = self._measure_flops_per_token(pl_module, batch, tokens)

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._last_global_step:
            return  # mid-accumulation: the optimizer step is not done yet
        self._last_global_step = trainer.global_step
        end = self._mark()
        self._tokens_per_step[self._step_tokens] += 1  # every step, measured or not: what was trained
        spans = [*self._step_spans, (self._step_start, end)]
        self._pending.append((self._step_index, spans, self._step_tokens, self._step_evaluating + self._evaluating()))
        self._step_index += 1
        self._step_tokens = 0
        self._step_spans, self._step_evaluating = [], 0.0
        self._start_clock(end)  # the next step starts now, data loading included
        every = trainer.log_every_n_steps
        if every > 0 and trainer.global_step % every == 0:
            self._log_interval(trainer, pl_module)
        elif every == 0 and len(self._pending) >= _MAX_PENDING:
            self._resolve()  # no step logging: only the summary at the end, from a bounded queue

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause()

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._pause()

    def _pause(self) -> None:
        if self._step_start is not None and self._step_tokens:
            self._step_spans.append((self._step_start, self._mark()))
            self._step_evaluating += self._evaluating()
        self._step_start = None

    def _start_clock(self, mark: Any) -> None:
        self._step_start = mark
        self._passes_seen = [len(evaluator.durations) for evaluator in self._evaluators]

    def _evaluating(self) -> float:
        """Seconds of evaluation passes run since the clock last started."""
        return sum(sum(e.durations[seen:]) for e, seen in zip(self._evaluators, self._passes_seen))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._resolve()
        self.summary = self._summarize(trainer, pl_module)
        if self.summary is None:
            rank_zero_info(
                f"throughput: only {len(self.steps)} optimizer step(s), all inside the "
                f"{self.warmup_steps} warm-up steps; no post-warm-up throughput to report."
            )
            return
        s = self.summary
        mfu = f", MFU {s['mfu']:.1%}" if s["mfu"] is not None else ""
        if s["tokens_per_optimizer_step"] is not None:
            per_step = f"{s['tokens_per_optimizer_step']:,} tokens per optimizer step"
        else:  # a data loader of its own (ours serves whole steps): say that the steps differ
            per_step = (
                f"{s['tokens_per_optimizer_step_min']:,} to {s['tokens_per_optimizer_step_max']:,} tokens per "
                "optimizer step: not every step trained the same"
            )
        rank_zero_info(
            f"throughput: {s['tokens_per_sec_median']:,.0f} tokens/s median over {s['measured_steps']} "
            f"post-warm-up steps ({s['step_ms_median']:.1f} ms/step{mfu}, {per_step}); "
            f"first step {s['first_step_s']:.2f} s, warm-up {s['warmup_s']:.2f} s"
        )
        log_dir = trainer.log_dir  # a collective under DDP: every rank must ask
        if self.filename and trainer.is_global_zero and log_dir:
            atomic_write_bytes(Path(log_dir) / self.filename, (json.dumps(s, indent=2) + "\n").encode())

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SystemExit) and self._step_index:  # stopped on a signal (Preempted)
            self.on_train_end(trainer, pl_module)  # every rank stops at the same step: the summary's reduces match

    def _measure_flops_per_token(self, pl_module: LightningModule, batch: Any, tokens: int) -> float | None:
        flops = self.flops_per_batch
        if flops is None and callable(getattr(pl_module, "training_flops", None)):
            x = batch[0] if isinstance(batch, (list, tuple)) else batch
            flops = pl_module.training_flops(*x.shape)
        if flops is None:
            flops = getattr(pl_module, "flops_per_batch", None)
        return flops / tokens if flops else None

    def _resolve(self) -> None:
        for index, spans, tokens, evaluating in self._pending:
            seconds = sum(self._seconds(start, end) for start, end in spans) - evaluating
            self.steps.append(StepTiming(index, seconds, tokens))
        self._pending.clear()

    def _log_interval(self, trainer: Trainer, pl_module: LightningModule) -> None:
        first_new = len(self.steps)
        self._resolve()
        new = self.steps[first_new:]
        # Once-only values go to the loggers directly: self.log would write them at every logging step.
        once = {}
        if any(step.index == 0 for step in new):
            once["throughput/first_step_s"] = self.steps[0].seconds
        if any(step.index == self.warmup_steps - 1 for step in new):
            once["throughput/warmup_s"] = self._warmup_seconds()
        if once and trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(once, step=trainer.global_step)
        measured = [step for step in new if step.index >= self.warmup_steps]
        seconds = sum(step.seconds for step in measured)
        if not measured or seconds <= 0:
            return
        (total,) = _summed_over_ranks(trainer, pl_module, [sum(step.tokens for step in measured) / seconds])
        metrics = {
            "throughput/tokens_per_sec": total,
            "throughput/tokens_per_sec_per_device": total / trainer.world_size,
            "throughput/step_ms": 1000.0 * seconds / len(measured),
        }
        mfu = self._mfu(total / trainer.world_size)
        if mfu is not None:
            metrics["throughput/mfu"] = mfu
        for name, value in metrics.items():
            pl_module.log(name, value, rank_zero_only=True)  # not prog_bar: see StepProgressBar

    def _warmup_seconds(self) -> float:
        return sum(step.seconds for step in self.steps if step.index < self.warmup_steps)

    def _mfu(self, tokens_per_sec_per_device: float) -> float | None:
        if self._flops_per_token is None or not self._peak:
            return None
        return tokens_per_sec_per_device * self._flops_per_token / self._peak

    def _summarize(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any] | None:
        measured = [step for step in self.steps if step.index >= self.warmup_steps]
        if not measured:
            return None
        world = trainer.world_size
        # Per-rank statistics of this rank's own steps, then summed over ranks: the job's rate.
        rates = [step.tokens / step.seconds for step in measured]
        step_ms = [1000.0 * step.seconds for step in measured]
        mean = sum(s.tokens for s in measured) / sum(s.seconds for s in measured)
        median, mean, p10, p90 = _summed_over_ranks(
            trainer, pl_module, [statistics.median(rates), mean, *_deciles(rates)]
        )
        device = pl_module.device
        if device.type == "cuda":
            device_name = torch.cuda.get_device_name(device)
            peak_memory = {"peak_device_memory_bytes": torch.cuda.max_memory_allocated(device)}
        else:
            device_name = platform.processor() or platform.machine()
            peak_memory = {"peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        first = self.steps[0]
        # What every optimizer step of this fit trained, all ranks: whether steps differed, fewest, most, total.
        counts = self._tokens_per_step
        trained = [len(counts) > 1, min(counts), max(counts), sum(t * n for t, n in counts.items())]
        uneven, fewest, most, total = _summed_over_ranks(trainer, pl_module, trained, torch.int64)
        return {
            "tokens_per_sec_median": median,
            "tokens_per_sec_mean": mean,
            "tokens_per_sec_p10": p10,
            "tokens_per_sec_p90": p90,
            "tokens_per_sec_per_device_median": median / world,
            "step_ms_median": statistics.median(step_ms),
            "mfu": self._mfu(median / world),
            "flops_per_token": self._flops_per_token,
            "peak_flops_per_device": self._peak,
            "measured_steps": len(measured),
            "warmup_steps": self.warmup_steps,
            "first_step_s": first.seconds,
            "warmup_s": self._warmup_seconds(),
            **peak_memory,
            "device": device_name,
            "accelerator": device.type,
            "precision": str(trainer.precision),
            "compiled": bool(getattr(pl_module, "is_compiled", False)),
            "world_size": world,
            "accumulate_grad_batches": trainer.accumulate_grad_batches,
            # null where steps differed; then the fewest and most say how far
            "tokens_per_step_per_device": max(counts) if not uneven else None,
            "tokens_per_optimizer_step": most if not uneven else None,
            "tokens_per_optimizer_step_min": fewest,
            "tokens_per_optimizer_step_max": most,
            "tokens_trained": total,
            "batch_size": getattr(trainer.datamodule, "batch_size", None),
            "block_size": getattr(trainer.datamodule, "block_size", None),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
        }
