"""Lightning must cost nothing: our Trainer loop vs a plain PyTorch loop, side by side, and where a
step's time goes in each.

Three loops train the same tiny GPT on the same batches at the same precision, from the same initial
weights and the same optimizer (``GPTLightningModule.configure_optimizers``: fused AdamW):

- ``plain``: the reference's loop (``TokenWindows`` read directly, the whole model compiled,
  ``zero_grad(set_to_none=True)``), as build-nanogpt writes it.
- ``plain_ours``: the same loop doing the work our module does: the data module's loader, the
  module's compile scope, ``NonFiniteGuard`` (the loss check, the gradient norm, the skip handed to
  fused AdamW as ``found_inf``), the micro-batch loss sum (its mean taken once per step) and the module's
  attention kernel (``training/attention.py``). ``plain_ours / plain`` is what our safety features and
  defaults cost or give; ``lightning / plain_ours`` is what Lightning costs.
- ``lightning``: ``GPTLightningModule`` + ``Trainer`` + ``TokenStreamDataModule`` +
  ``ThroughputMonitor`` + TensorBoard, the progress bar a plain ``Trainer`` gives (``--progress_bar
  step``: the CLI's ``StepProgressBar``), logging every 10 steps (as every config does).

Runs rotate (each round starts from the next loop: plain, plain_ours, lightning; then the round
plain_ours, lightning, plain run backwards; ...) so drift in a noisy machine hits all; each run's
post-warm-up step times are pooled and the medians compared, and, so that the steps at logging
intervals count too, the total times. A short run of each loop (past its first logging step) goes
first and is left out: a process's first run paid for its first allocations and first-touched pages
(in one run its loop came out a third slower), and the rotation always gave that run to ``plain``.
Every run also records where its steps' time goes (host timers around each part: data, forward,
backward, AdamW, zero_grad, each of our per-step pieces, the logger, the progress bar, Lightning's
own loop as the rest), Python's garbage collection and the CPU other threads took, with the load
average. On CUDA the timers are host time (what the host must keep ahead of the device); step times
come from CUDA events.

    python benchmarks/lightning_overhead.py          # eager and compiled; JSON + markdown table into
                                                     # benchmarks/results/<cpu-Ncore | GPU name>/
    python benchmarks/lightning_overhead.py --compile true --steps 60 --rounds 6
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.profilers import Profiler

from gpt_lightning import GPTLightningModule, ThroughputMonitor, TokenStreamDataModule
from gpt_lightning.commands.bench import repo_relative
from gpt_lightning.data.windows import TokenWindows
from gpt_lightning.host_memory import keep_freed_memory
from gpt_lightning.loss import chunked_cross_entropy
from gpt_lightning.observing.console import StepProgressBar
from gpt_lightning.training.attention import attention_context, device_attention_backends
from gpt_lightning.training.compilation import compile_in_place
from gpt_lightning.training.nonfinite import NonFiniteGuard

LOOPS = ("plain", "plain_ours", "lightning")
# The parts a step is split into, in table order. "rest" is the step's time no timer covered: in
# the plain loops the Python loop itself, in ours Lightning's loop (hooks, result collection, ...).
PARTS = (
    "data",
    "forward",
    "backward",
    "optimizer",
    "zero_grad",
    "nonfinite_guard",
    "step_logging",
    "throughput_monitor",
    "progress_bar",
    "logger",
    "other_hooks",
    "rest",
)
OURS = ("nonfinite_guard", "step_logging", "throughput_monitor", "progress_bar", "logger", "other_hooks")
# The host's own work, beside the compute (forward, backward, AdamW) the loops share: what Lightning
# adds to a step is the difference of these between ours and plain_ours. It is measured to a fraction
# of a millisecond, where the step times of whole runs differ by several percent on a shared machine.
HOST = ("data", "zero_grad", *OURS, "rest")
# What Lightning adds, by who does it: its own loop (fetching, hooks, the closure, progress tracking,
# zero_grad's place), the callbacks and logger a Trainer run has, and our module's hooks run by it.
ADDED_BY = {
    "trainer_loop": ("data", "zero_grad", "rest"),
    "callbacks_and_logger": ("throughput_monitor", "progress_bar", "logger"),
    "module_hooks": ("nonfinite_guard", "step_logging", "other_hooks"),
}


class Breakdown:
    """Exclusive host time per part and step: a part timed inside another is taken out of it."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._now: dict[str, float] = defaultdict(float)
        self._stack: list[tuple[str, float]] = []
        self._step_start = time.perf_counter()
        self._faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        self._gc_start: float | None = None
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self._now["gc"] += time.perf_counter() - self._gc_start  # also inside the part it interrupted
            self._gc_start = None

    def close(self) -> None:
        gc.callbacks.remove(self._on_gc)

    def start(self, part: str) -> None:
        self._stack.append((part, time.perf_counter()))

    def stop(self) -> None:
        part, began = self._stack.pop()
        seconds = time.perf_counter() - began
        self._now[part] += seconds
        if self._stack:
            self._now[self._stack[-1][0]] -= seconds

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        self.start(name)
        try:
            yield
        finally:
            self.stop()

    def end_step(self) -> None:
        now = time.perf_counter()
        step = dict(self._now)
        step["step"] = now - self._step_start
        step["rest"] = step["step"] - sum(v for k, v in step.items() if k in PARTS and k != "rest")
        step["other_threads_cpu"] = other_threads_cpu_seconds()  # {thread: CPU seconds so far}
        # pages the step touched for the first time (the kernel zeroes each): equal work in every loop
        # means the same allocations, so a difference in compute time is not the allocator's
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step["page_faults"], self._faults_start = faults - self._faults_start, faults
        self.steps.append(step)
        self._now = defaultdict(float)
        self._step_start = now


def other_threads_cpu_seconds() -> dict[str, float]:
    """CPU seconds used so far by each of this process's Python threads other than the main one (a
    progress bar's refresh thread, a logger's writer), by class name: from /proc, none where it is
    not there."""
    seconds: dict[str, float] = defaultdict(float)
    for thread in threading.enumerate():
        if thread is threading.main_thread() or thread.native_id is None:
            continue
        try:
            fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[type(thread).__name__] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return dict(seconds)


def timed(breakdown: Breakdown, part: str, function):
    def wrapper(*args, **kwargs):
        with breakdown.part(part):
            return function(*args, **kwargs)

    return wrapper


def make_module(args: argparse.Namespace, compiled: bool) -> GPTLightningModule:
    seed_everything(0, verbose=False)
    return GPTLightningModule(
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        compile=compiled,
        val_sample_tokens=0,
    )


class StepClock:
    """Step durations: perf_counter on CPU; CUDA events on GPU, read once at the end (no per-step sync)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = [self._mark()]

    def _mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def tick(self) -> None:
        self.marks.append(self._mark())

    def seconds(self) -> list[float]:
        if self.cuda:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def plain_loop(args, data: TokenStreamDataModule, compiled: bool, device: torch.device, ours: bool) -> dict:
    """The reference's loop (``ours``: doing our module's work too). Returns step seconds and breakdown."""
    module = make_module(args, False).to(device)
    model = module.model
    if compiled:
        if ours:
            compile_in_place(model, module.hparams.compile_scope, dynamic=False)  # as GPTLightningModule does
        else:
            model.compile(dynamic=False)  # the reference: torch.compile(model)
    optimizer = module.configure_optimizers()
    if ours:
        batches_of = data.train_dataloader  # the data module's loader, as the Trainer uses it
    else:
        windows = TokenWindows(data.tokens[: data.train_token_count], args.batch_size, args.block_size)
        batches_of = lambda: windows  # noqa: E731
    guard, step_losses = NonFiniteGuard(), []
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed")
    parameters = [p for p in model.parameters() if p.requires_grad]
    breakdown, batches = Breakdown(), iter(())
    clock = StepClock(device)
    # the module's attention kernel (cuDNN's on Hopper where asked for): part of ours
    hp = module.hparams
    backends = device_attention_backends(device, cudnn_attention=hp.cudnn_attention)
    for step in range(args.steps):
        with breakdown.part("data"):
            batch = next(batches, None)
            if batch is None:
                batches = iter(batches_of())
                batch = next(batches)
            x, y = (t.to(device, non_blocking=True) for t in batch)
        with breakdown.part("forward"):
            with autocast, attention_context(backends if ours else None):
                head_loss = chunked_cross_entropy if ours and module.uses_chunked_loss(device) else None
                _, loss = model(x, y, head_loss=head_loss)  # as training_step
        if ours:
            with breakdown.part("nonfinite_guard"):
                guard.observe_loss(loss)
            with breakdown.part("step_logging"):
                step_losses.append(loss.detach())
        with breakdown.part("backward"):
            loss.backward()
        if ours:
            with breakdown.part("step_logging"):
                torch.stack(step_losses).mean()  # the module's on_before_optimizer_step (logged only with a logger)
                step_losses.clear()
            with breakdown.part("nonfinite_guard"):
                skip = guard.skip_update(step, [p.grad for p in parameters if p.grad is not None])
                optimizer.found_inf = skip.float()  # fused AdamW leaves weights and moments untouched
        with breakdown.part("optimizer"):
            optimizer.step()
        with breakdown.part("zero_grad"):
            optimizer.zero_grad(set_to_none=True)
        clock.tick()
        breakdown.end_step()
    if ours:
        guard.raise_if_found(args.steps)
    breakdown.close()
    return {
        "seconds": clock.seconds()[args.warmup :],
        "breakdown": breakdown.steps[args.warmup :],
        "setup": describe_setup(
            optimizer,
            compiled and (module.hparams.compile_scope if ours else "model"),
            "TokenStreamDataModule.train_dataloader" if ours else "TokenWindows, read directly",
            args.precision,
            progress_bar=None,
            logger=None,
        ),
    }


class PartsProfiler(Profiler):
    """Lightning's profiler hook, used to time the actions it names (data fetch, transfer, the
    strategy's training_step and backward, every callback hook) into a ``Breakdown``."""

    def __init__(self, breakdown: Breakdown, bar_name: str) -> None:
        super().__init__()
        self.breakdown, self.bar_name = breakdown, bar_name
        self.active = False  # only inside the training loop
        self._open: list[bool] = []

    def part_of(self, action: str) -> str | None:
        if action.endswith(("train_dataloader_next", "batch_to_device")):
            return "data"
        if action.startswith("[Strategy]") and action.endswith(".training_step"):
            return "forward"
        if action.startswith("[Strategy]") and action.endswith(".backward"):
            return "backward"
        if action.endswith(".optimizer_zero_grad"):
            return "zero_grad"
        if action.startswith("[Callback]ThroughputMonitor"):
            return "throughput_monitor"
        if action.startswith(f"[Callback]{self.bar_name}"):
            return "progress_bar"
        if action.startswith("[LightningModule]") and action.endswith(
            (".on_train_batch_end", ".configure_gradient_clipping")
        ):
            # check_at_logging_interval (and, at a stop, the step's logging); clip_gradients (the guard's norm)
            return "nonfinite_guard"
        if action.startswith("[LightningModule]") and action.endswith(".on_train_batch_start"):
            return "other_hooks"  # resume.align_logging_step
        return None  # on_before_optimizer_step is split by the wrappers below; the rest is Lightning's

    def start(self, action_name: str) -> None:
        part = self.part_of(action_name) if self.active else None
        self._open.append(part is not None)
        if part is not None:
            self.breakdown.start(part)

    def stop(self, action_name: str) -> None:
        if self._open.pop():
            self.breakdown.stop()

    def summary(self) -> str:
        return ""


class Instrument(Callback):
    """Marks step boundaries and wraps what Lightning's profiler does not name: AdamW's own step
    (without the closure it runs), our hooks' pieces and the logger."""

    def __init__(self, breakdown: Breakdown, profiler: PartsProfiler) -> None:
        self.breakdown, self.profiler = breakdown, profiler

    def on_train_start(self, trainer: Trainer, pl_module: GPTLightningModule) -> None:
        b = self.breakdown
        (optimizer,) = trainer.optimizers
        step = optimizer.step

        def timed_step(closure=None, **kwargs):
            with b.part("optimizer"):
                # the closure's own glue (Lightning's) is "rest"; what it runs is timed inside it
                return step(closure=None if closure is None else timed(b, "rest", closure), **kwargs)

        optimizer.step = timed_step
        guard = pl_module._nonfinite
        guard.observe_loss = timed(b, "nonfinite_guard", guard.observe_loss)
        # the module's hook: the step's mean loss, the guard (timed as its own part inside it), and
        # the logging of train/loss and train/grad_norm on the steps the logger writes
        pl_module.on_before_optimizer_step = timed(b, "step_logging", pl_module.on_before_optimizer_step)
        guard.before_optimizer_step = timed(b, "nonfinite_guard", guard.before_optimizer_step)
        for logger in trainer.loggers:
            logger.log_metrics = timed(b, "logger", logger.log_metrics)
            logger.save = timed(b, "logger", logger.save)
        self.profiler.active = True
        b.end_step()  # steps start now (the setup before it is no step's)
        b.steps.clear()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        self.breakdown.end_step()

    def on_train_end(self, trainer: Trainer, pl_module: GPTLightningModule) -> None:
        self.profiler.active = False


def lightning_loop(args, data: TokenStreamDataModule, compiled: bool, log_dir: str) -> dict:
    module = make_module(args, compiled)
    monitor = ThroughputMonitor(warmup_steps=args.warmup, filename=None)
    breakdown = Breakdown()
    bars = [StepProgressBar()] if args.progress_bar == "step" else []  # else the one a plain Trainer gives
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=1,
        precision=args.precision,
        max_steps=args.steps,
        logger=TensorBoardLogger(log_dir, name="overhead"),
        callbacks=[monitor, *bars],
        enable_checkpointing=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        log_every_n_steps=args.log_every,
    )
    bar = trainer.progress_bar_callback  # what a plain Trainer gives
    profiler = PartsProfiler(breakdown, type(bar).__qualname__ if bar is not None else "-")
    trainer.profiler = profiler  # Lightning reads trainer.profiler at every hook; a public attribute
    trainer.callbacks.append(Instrument(breakdown, profiler))
    trainer.fit(module, data)
    data.trainer = None  # the next loop's loader must not read this finished trainer (its position, pinning)
    breakdown.close()
    # ThroughputMonitor marks a step at its on_train_batch_end, Instrument at its own: the same steps.
    steps = breakdown.steps[args.warmup : args.steps]
    return {
        "seconds": [s.seconds for s in monitor.steps if s.index >= args.warmup],
        "breakdown": steps,
        "setup": describe_setup(
            trainer.optimizers[0],
            compiled and module.hparams.compile_scope,
            "TokenStreamDataModule.train_dataloader",
            str(trainer.precision),
            progress_bar=type(bar).__name__ if bar is not None else None,
            logger=f"TensorBoardLogger, every {trainer.log_every_n_steps} steps",
        ),
    }


def run_loop(
    loop: str, args, data: TokenStreamDataModule, compiled: bool, device: torch.device, log_dir: str, steps: int
) -> dict:
    """One run of ``loop`` for ``steps`` steps, compiling afresh."""
    torch._dynamo.reset()
    args = argparse.Namespace(**{**vars(args), "steps": steps})
    if loop == "lightning":
        return lightning_loop(args, data, compiled, log_dir)
    return plain_loop(args, data, compiled, device, ours=loop == "plain_ours")


def describe_setup(
    optimizer: torch.optim.Optimizer,
    compile_scope,
    data_path: str,
    precision: str,
    progress_bar: str | None,
    logger: str | None,
) -> dict:
    """What each loop ran with, for the fairness check: everything here but the data path, compile,
    progress bar and logger must be the same in all loops."""
    defaults = {k: v for k, v in optimizer.defaults.items() if isinstance(v, (bool, int, float, tuple, type(None)))}
    return {
        "optimizer": type(optimizer).__name__,
        "optimizer_flags": defaults,
        "weight_decay_groups": [g["weight_decay"] for g in optimizer.param_groups],
        "compile": compile_scope or None,
        "data_path": data_path,
        "precision": precision,
        "zero_grad_set_to_none": True,  # the plain loops' call; Lightning's optimizer_zero_grad calls zero_grad()
        "torch_threads": torch.get_num_threads(),
        "progress_bar": progress_bar,
        "logger": logger,
    }


def load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def compute_ms(run: dict) -> float:
    """A run's median ms per step of the compute all loops share: forward, backward and AdamW."""
    return 1000 * statistics.median(
        sum(s.get(part, 0.0) for part in ("forward", "backward", "optimizer")) for s in run["breakdown"]
    )


def summarize_breakdown(runs: list[dict]) -> dict[str, dict[str, float]]:
    """Per part: median and mean ms per step over the pooled steps of all runs of one loop."""
    steps = [s for run in runs for s in run["breakdown"]]
    out = {}
    for part in (*PARTS, "gc", "step"):
        values = [1000 * s.get(part, 0.0) for s in steps]
        out[part] = {"median_ms": statistics.median(values), "mean_ms": statistics.fmean(values)}
    threads: dict[str, list[float]] = defaultdict(list)
    for run in runs:
        b = run["breakdown"]
        if len(b) > 1:
            first, last = b[0]["other_threads_cpu"], b[-1]["other_threads_cpu"]
            for name in set(first) | set(last):
                threads[name].append(1000 * (last.get(name, 0.0) - first.get(name, 0.0)) / (len(b) - 1))
    per_thread = {name: statistics.fmean(v) for name, v in threads.items()}
    out["other_threads_cpu"] = {"mean_ms": sum(per_thread.values()), "by_thread_ms": per_thread}
    out["page_faults"] = {"median": statistics.median(s["page_faults"] for s in steps)}
    out["ours_total"] = {"mean_ms": sum(out[p]["mean_ms"] for p in OURS)}
    return out


def markdown(results: dict, load: tuple) -> str:
    lines = [
        f"Load average {load[0]:.2f} at the start, {load[1]:.2f} at the end.",
        "",
        "| mode | plain tok/s | plain + our work tok/s | ours (Lightning) tok/s | ours / plain (target >= 0.98) "
        "| per-round median | total time | our work / plain | Lightning / plain + our work | estimate from host time (CPU) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        t = r["tokens_per_sec_median"]
        lines.append(
            f"| {mode} | {t['plain']:,.0f} | {t['plain_ours']:,.0f} | {t['lightning']:,.0f} | "
            f"{r['ratio']:.3f} | {r['ratio_per_round_median']:.3f} | {r['ratio_total_time']:.3f} | "
            f"{r['our_work_ratio']:.3f} | {r['lightning_ratio']:.3f} | {r['ratio_from_host_time']:.3f} |"
        )
    lines += [
        "",
        "Host ms per step beside the shared compute (" + ", ".join(HOST) + "), and each round's ratio "
        "(ours / plain: its spread is the machine's noise):",
        "",
        "| mode | plain | plain + our work | ours (Lightning) | added by Lightning (its loop, callbacks and "
        "logger, our hooks) | added by our work | added, of a plain step | per-round ratios "
        "| per-round compute, Lightning / plain + our work |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in results.items():
        h, by = r["host_ms_per_step"], r["host_ms_added_by_lightning_parts"]
        lines.append(
            f"| {mode} | {h['plain']:.2f} | {h['plain_ours']:.2f} | {h['lightning']:.2f} | "
            f"{r['host_ms_added_by_lightning']:.2f} ({by['trainer_loop']:.2f}, {by['callbacks_and_logger']:.2f}, "
            f"{by['module_hooks']:.2f}) | {r['host_ms_added_by_our_work']:.2f} | "
            f"{r['host_added_fraction_of_plain_step']:.2%} | "
            + ", ".join(f"{x:.3f}" for x in r["ratio_per_round"])
            + " | "
            + ", ".join(f"{x:.3f}" for x in r["compute_ratio_per_round"])
            + " |"
        )
    lines += [
        "",
        "Mean host ms per step (the parts exclusive of each other; `rest`: the loop itself, in ours Lightning's):",
        "",
    ]
    header = "| part | " + " | ".join(f"{mode} {loop}" for mode in results for loop in LOOPS) + " |"
    lines += [header, "|---|" + "---|" * (len(results) * len(LOOPS))]
    for part in (*PARTS, "step", "gc", "other_threads_cpu", "ours_total"):
        cells = [results[mode]["breakdown"][loop][part]["mean_ms"] for mode in results for loop in LOOPS]
        lines.append(f"| {part} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    faults = [results[mode]["breakdown"][loop]["page_faults"]["median"] for mode in results for loop in LOOPS]
    lines.append("| page faults (median) | " + " | ".join(f"{f:,.0f}" for f in faults) + " |")
    lines += ["", "`other_threads_cpu` by thread (CPU ms per step, mean over runs):", ""]
    for mode in results:
        for loop in LOOPS:
            by_thread = results[mode]["breakdown"][loop]["other_threads_cpu"]["by_thread_ms"]
            if by_thread:
                lines.append(
                    f"- {mode} {loop}: " + ", ".join(f"`{name}` {ms:.2f}" for name, ms in sorted(by_thread.items()))
                )
    return "\n".join(lines) + "\n"


def default_out() -> str:
    if torch.cuda.is_available():
        where = torch.cuda.get_device_name().replace(" ", "_").replace("/", "_")
    else:
        where = f"cpu-{os.cpu_count()}core"
    return f"benchmarks/results/{where}/lightning_overhead.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_path", default=None, help="text file; default: tiny Shakespeare")
    parser.add_argument("--accelerator", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default=None, help="default: bf16-mixed on CUDA, 32-true on CPU")
    parser.add_argument("--compile", choices=["false", "true", "both"], default="both")
    parser.add_argument("--steps", type=int, default=25, help="steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of each run")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each loop, in rotated order")
    parser.add_argument("--log_every", type=int, default=10, help="the Trainer's log_every_n_steps (as every config)")
    parser.add_argument(
        "--progress_bar",
        choices=["default", "step"],
        default="default",
        help="default: the bar a plain Trainer gives (RichProgressBar where rich is installed, else "
        "TQDMProgressBar); step: StepProgressBar, the one gpt-lightning's CLI attaches",
    )
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--out", default=None, help="JSON path (a .md table beside it); default: " + default_out())
    args = parser.parse_args()
    args.out = args.out or default_out()
    args.precision = args.precision or ("bf16-mixed" if args.accelerator == "cuda" else "32-true")
    device = torch.device(args.accelerator)
    if device.type == "cpu":
        keep_freed_memory()  # what GPTLightningModule.setup does, here before any loop: all see one allocator
    tokens_per_step = args.batch_size * args.block_size
    load_start = load_average()

    data = TokenStreamDataModule(
        args.data_path, batch_size=args.batch_size, block_size=args.block_size, val_fraction=0.0
    )
    data.prepare_data()
    data.setup("fit")
    results = {}
    modes = {"false": [False], "true": [True], "both": [False, True]}[args.compile]
    with tempfile.TemporaryDirectory() as log_dir:
        for compiled in modes:
            runs: dict[str, list[dict]] = {loop: [] for loop in LOOPS}
            loads = []
            left_out_steps = max(args.warmup + 2, args.log_every + 1)  # past a logging step
            for loop in LOOPS:  # left out: see the module's docstring
                run_loop(loop, args, data, compiled, device, log_dir, steps=left_out_steps)
            for round_index in range(args.rounds):
                shift = round_index % len(LOOPS)
                order = list(LOOPS[shift:] + LOOPS[:shift])
                for loop in order if round_index % 2 == 0 else order[::-1]:
                    run = run_loop(loop, args, data, compiled, device, log_dir, steps=args.steps)
                    run["round"], run["load_average"] = round_index, load_average()
                    runs[loop].append(run)
                    loads.append(run["load_average"])
            pooled = {loop: [t for run in v for t in run["seconds"]] for loop, v in runs.items()}
            rate = {loop: tokens_per_step / statistics.median(v) for loop, v in pooled.items()}
            # every step counted: a median never sees the steps at logging intervals
            rate_total = {loop: tokens_per_step * len(v) / sum(v) for loop, v in pooled.items()}
            # each round's ratio: drift between rounds cancels in it
            paired = [
                tokens_per_step
                / statistics.median(runs["lightning"][i]["seconds"])
                / (tokens_per_step / statistics.median(runs["plain"][i]["seconds"]))
                for i in range(args.rounds)
            ]
            name = "compiled" if compiled else "eager"
            results[name] = {
                "tokens_per_sec_median": rate,
                "ratio": rate["lightning"] / rate["plain"],
                "ratio_per_round_median": statistics.median(paired),
                "tokens_per_sec_total_time": rate_total,
                "ratio_total_time": rate_total["lightning"] / rate_total["plain"],
                "left_out_runs": {"steps": left_out_steps, "loops": list(LOOPS)},
                "our_work_ratio": rate["plain_ours"] / rate["plain"],
                "lightning_ratio": rate["lightning"] / rate["plain_ours"],
                "steps_measured_each": len(pooled["plain"]),
                # The spread between runs of one loop shows how much of the ratio is machine noise.
                "per_run_tokens_per_sec": {
                    loop: [tokens_per_step / statistics.median(run["seconds"]) for run in v] for loop, v in runs.items()
                },
                "breakdown": {loop: summarize_breakdown(v) for loop, v in runs.items()},
                # per-round ratios: their spread is the machine's noise on the ratio above
                "ratio_per_round": paired,
                # each round's compute (forward + backward + AdamW, median ms): Lightning's over the
                # plain loop doing our work, the same computation, so a ratio away from 1 is the machine
                "compute_ratio_per_round": [
                    compute_ms(runs["lightning"][i]) / compute_ms(runs["plain_ours"][i]) for i in range(args.rounds)
                ],
                "setup": {loop: v[0]["setup"] for loop, v in runs.items()},
                "load_average_per_run": loads,
            }
            breakdown = results[name]["breakdown"]
            host = {loop: sum(breakdown[loop][part]["mean_ms"] for part in HOST) for loop in LOOPS}
            step_ms = breakdown["plain"]["step"]["median_ms"]
            results[name]["host_ms_per_step"] = host
            results[name]["host_ms_added_by_lightning"] = host["lightning"] - host["plain_ours"]
            results[name]["host_ms_added_by_lightning_parts"] = {
                who: sum(
                    breakdown["lightning"][part]["mean_ms"] - breakdown["plain_ours"][part]["mean_ms"] for part in parts
                )
                for who, parts in ADDED_BY.items()
            }
            results[name]["host_ms_added_by_our_work"] = host["plain_ours"] - host["plain"]
            results[name]["host_added_fraction_of_plain_step"] = (host["lightning"] - host["plain"]) / step_ms
            # CPU only: the ratio were the shared compute (forward, backward, AdamW) equal in all loops,
            # as the work is (the same model, batches, flags and threads), from the means of every step
            # (logging steps too): the host time Lightning and our pieces add, and the CPU other threads
            # took (a bar's refresh thread competes for the 2 cores). It is an estimate, not the target's
            # measure: the measured ratios above are; on a shared machine the compute of identical runs
            # drifts by more than the target's 2% (compute_ratio_per_round), and this figure shows what
            # is left when that drift is taken out. On a GPU, host time is not step time: see the ratios.
            added = {loop: host[loop] + breakdown[loop]["other_threads_cpu"]["mean_ms"] for loop in LOOPS}
            plain_mean = breakdown["plain"]["step"]["mean_ms"]
            results[name]["ratio_from_host_time"] = plain_mean / (plain_mean + added["lightning"] - added["plain"])
            setups = results[name]["setup"]
            same = (
                "optimizer",
                "optimizer_flags",
                "weight_decay_groups",
                "precision",
                "zero_grad_set_to_none",
                "torch_threads",
            )
            unfair = [key for key in same if len({json.dumps(s[key], sort_keys=True) for s in setups.values()}) > 1]
            results[name]["unequal_settings"] = unfair
            if unfair:
                print(f"WARNING ({name}): the loops differ in {unfair}")
    load = (load_start or 0.0, load_average() or 0.0)
    print(f"\n{'mode':<9} {'plain tok/s':>12} {'plain+ours':>11} {'lightning':>10} {'ratio':>7}   (target >= 0.98)")
    for name, r in results.items():
        t = r["tokens_per_sec_median"]
        print(
            f"{name:<9} {t['plain']:>12,.0f} {t['plain_ours']:>11,.0f} {t['lightning']:>10,.0f} {r['ratio']:>7.3f}"
            f"   per-round median {r['ratio_per_round_median']:.3f}, total time {r['ratio_total_time']:.3f},"
            f" estimate from host time {r['ratio_from_host_time']:.3f}"
        )
        for loop, rates in r["per_run_tokens_per_sec"].items():
            print(f"    {loop} runs: " + ", ".join(f"{rate:,.0f}" for rate in rates))
    table = markdown(results, load)
    print("\n" + table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "args": repo_relative(vars(args)),
        "load_average": {"start": load[0], "end": load[1]},
        "cpu_count": os.cpu_count(),
        "results": results,
    }
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(table)
    print(f"saved {out} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
