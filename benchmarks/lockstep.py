"""Runs trained in lockstep: the shared pieces of ``optimizers.py`` and ``architectures.py``.

Every run sees the same data (tiny Shakespeare, GPT-2 tokens), the same training windows in the
same order, the same held-out windows and the same schedule (warm-up, stable, linear decay:
``lr_schedule="wsd"``); the runs step one step each in turn, in a rotating order, so the machine's
load falls on all of them alike and their time-per-step ratios are measured side by side.
Validation loss every ``eval_every`` steps; ``tokens_to_reach`` reads a curve against a target loss.
"""

from __future__ import annotations

import argparse
import gzip
import math
import statistics
import time
from importlib.resources import files

import torch
from torch.optim.lr_scheduler import LambdaLR

from gpt_lightning.data import gpt2_encoding
from gpt_lightning.model import GPT
from gpt_lightning.training.optimizers import lr_multiplier

Batch = tuple[torch.Tensor, torch.Tensor]


def tokens(compact: bool) -> tuple[torch.Tensor, int]:
    """Tiny Shakespeare's GPT-2 tokens and the vocabulary size to build for them. ``compact``
    renumbers the tokens it uses densely: the 50257-row head would otherwise be most of a small
    model's step on a CPU."""
    text = gzip.decompress((files("gpt_lightning.data") / "tinyshakespeare.txt.gz").read_bytes()).decode()
    ids = torch.tensor(gpt2_encoding().encode_ordinary(text), dtype=torch.long)
    if not compact:
        return ids, 50304
    used, dense = torch.unique(ids, return_inverse=True)  # renumbered 0 .. len(used) - 1
    return dense, 64 * math.ceil(len(used) / 64)


def add_arguments(parser: argparse.ArgumentParser, **defaults) -> None:
    """The options every lockstep benchmark takes (shape, schedule, evaluation, seed)."""
    options = dict(
        device="cuda" if torch.cuda.is_available() else "cpu",
        n_layer=4,
        n_head=4,
        n_embd=64,
        batch_size=8,
        block_size=64,
        steps=60,
        warmup_steps=3,
        decay_fraction=0.3,
        eval_every=6,
        eval_batches=4,
        seed=0,
    )
    options.update(defaults)
    for name, value in options.items():
        parser.add_argument(f"--{name}", type=type(value), default=value)
    parser.add_argument(
        "--compact_vocab",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="renumber the used tokens densely (default: on a CPU)",
    )


SHAPE = (
    "device",
    "n_layer",
    "n_head",
    "n_embd",
    "batch_size",
    "block_size",
    "steps",
    "warmup_steps",
    "decay_fraction",
    "eval_every",
    "eval_batches",
)


class Data:
    """The training windows of every step (drawn from ``seed``) and the held-out windows (the last
    tenth of the tokens, evenly spaced), the same for every run of a lockstep."""

    def __init__(self, ids: torch.Tensor, args: argparse.Namespace, seed: int) -> None:
        n_val = len(ids) // 10
        self.train, held_out = ids[:-n_val], ids[-n_val:]
        self.B, self.T, self.device = args.batch_size, args.block_size, args.device
        generator = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, len(self.train) - self.T - 1, (args.steps, self.B), generator=generator)
        n = args.eval_batches * self.B
        val_starts = (torch.arange(n) * ((len(held_out) - self.T - 1) // n)).tolist()
        self.val = [self.windows(held_out, val_starts[k * self.B : (k + 1) * self.B]) for k in range(args.eval_batches)]

    def windows(self, data: torch.Tensor, starts: list[int]) -> Batch:
        x = torch.stack([data[i : i + self.T] for i in starts])  # (B, T)
        y = torch.stack([data[i + 1 : i + 1 + self.T] for i in starts])  # (B, T): the next tokens
        return x.to(self.device), y.to(self.device)

    def batch(self, step: int) -> Batch:
        return self.windows(self.train, self.starts[step].tolist())


class Run:
    """One model and its optimizer under the WSD schedule, trained one step at a time: forward in
    bf16 autocast on CUDA (float32 on a CPU), gradients clipped to norm 1, as the package trains."""

    def __init__(self, name: str, model: GPT, optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> None:
        self.name, self.model, self.optimizer, self.device = name, model, optimizer, args.device
        schedule = dict(
            warmup_steps=args.warmup_steps,
            lr_schedule="wsd",
            cosine_decay_steps=None,
            decay_fraction=args.decay_fraction,
            min_lr_ratio=0.0,
            total_steps=args.steps,
        )
        self.scheduler = LambdaLR(optimizer, lambda step: lr_multiplier(step, **schedule))
        self.step_seconds: list[float] = []
        self.curve: list[tuple[int, float]] = []  # (tokens, validation loss)

    def before_step(self, step: int) -> None:
        """A subclass's change to the optimizer before step ``step`` (none here)."""

    def step(self, x: torch.Tensor, y: torch.Tensor, step: int) -> None:
        self.before_step(step)
        start = time.perf_counter()
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.device == "cuda"):
            loss = self.model(x, y)[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.step_seconds.append(time.perf_counter() - start)

    @torch.no_grad()
    def evaluate(self, val: list[Batch], tokens_seen: int) -> float:
        self.model.eval()
        with torch.autocast(self.device, dtype=torch.bfloat16, enabled=self.device == "cuda"):
            loss = statistics.fmean(float(self.model(x, y)[1]) for x, y in val)
        self.model.train()
        self.curve.append((tokens_seen, loss))
        return loss

    def median_step_s(self) -> float:
        """The median step time past the first tenth of the steps (allocator and caches warm)."""
        return statistics.median(self.step_seconds[len(self.step_seconds) // 10 :])


def train_in_lockstep(runs: list[Run], data: Data, args: argparse.Namespace) -> float:
    """Train ``runs`` for ``args.steps`` steps, one step each in a rotating order (no run is always
    first after the data), evaluating all of them every ``args.eval_every`` steps. Returns the wall seconds."""
    started = time.perf_counter()
    for run in runs:
        run.evaluate(data.val, 0)
    for step in range(args.steps):
        x, y = data.batch(step)
        for k in range(len(runs)):
            runs[(step + k) % len(runs)].step(x, y, step)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            losses = [run.evaluate(data.val, (step + 1) * data.B * data.T) for run in runs]
            print(
                f"step {step + 1} ({time.perf_counter() - started:.0f} s): "
                + ", ".join(f"{r.name} {loss:.3f}" for r, loss in zip(runs, losses)),
                flush=True,
            )
    return time.perf_counter() - started


def tokens_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """The tokens at which ``curve`` first reaches ``target``, interpolated linearly between evaluations."""
    if curve and curve[0][1] <= target:  # at the first evaluation (a curve without one before training)
        return curve[0][0]
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None
