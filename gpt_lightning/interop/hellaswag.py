"""HellaSwag scored build-nanogpt's way: for each of the 4 endings, the mean cross-entropy of its
tokens given the context, the lowest winning (``acc_norm``; ``acc`` sums instead); several examples
per forward pass. ``HellaSwagEval`` scores the model being trained, the examples split across ranks.
How this differs from the harness's ``hellaswag``: docs/hellaswag.md."""

from __future__ import annotations

import contextlib
import itertools
import json
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from gpt_lightning.atomic import atomic_write_bytes
from gpt_lightning.data.corpus import default_cache_dir
from gpt_lightning.data.tokenizer import gpt2_encoding
from gpt_lightning.errors import UserError
from gpt_lightning.model import GPT

VAL_URL = "https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl"
VAL_EXAMPLES = 10_042


@dataclass(frozen=True)
class Example:
    context: str
    endings: tuple[str, ...]
    label: int


def cached_file(cache_dir: Path) -> Path:
    """Where ``hellaswag_val.jsonl`` is kept in the cache."""
    return cache_dir / "hellaswag" / "hellaswag_val.jsonl"


def validation_file(cache_dir: Path) -> Path:
    """The cached ``hellaswag_val.jsonl``, downloaded once when it is not there yet."""
    path = cached_file(cache_dir)
    if path.is_file():
        return path
    try:
        with urllib.request.urlopen(VAL_URL, timeout=60) as response:
            data = response.read()
    except OSError as err:
        raise UserError(
            f"Could not download HellaSwag's validation set ({err}). Download {VAL_URL} yourself and put "
            f"it at {path}, or pass it with --data_file."
        ) from None
    lines = data.count(b"\n")
    if lines != VAL_EXAMPLES:
        raise UserError(f"The file downloaded from {VAL_URL} has {lines} lines, not {VAL_EXAMPLES}; nothing was cached.")
    atomic_write_bytes(path, data)
    return path


def read_examples(path: Path) -> Iterator[Example]:
    """Examples of a HellaSwag JSONL file (``ctx``, ``endings``, ``label`` per line)."""
    if not path.is_file():
        raise UserError(f"HellaSwag file {path} does not exist.")
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            try:
                item = json.loads(line)
                example = Example(item["ctx"], tuple(item["endings"]), int(item["label"]))
            except (ValueError, KeyError, TypeError) as err:
                raise UserError(f"{path}, line {number}: not a HellaSwag example ({err}).") from None
            if len(example.endings) != 4 or not 0 <= example.label < 4:
                raise UserError(f"{path}, line {number}: expected 4 endings and a label 0-3.")
            yield example


def render(example: Example, encode) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (4, L) of context + each ending, zero-padded, and a mask (4, L) of ending tokens."""
    context = encode(example.context)
    endings = [encode(" " + ending) for ending in example.endings]  # GPT-2 BPE: the space starts the word
    length = len(context) + max(len(e) for e in endings)
    tokens = torch.zeros((4, length), dtype=torch.long)
    mask = torch.zeros((4, length), dtype=torch.bool)
    for row, ending in enumerate(endings):
        tokens[row, : len(context) + len(ending)] = torch.tensor(context + ending)
        mask[row, len(context) : len(context) + len(ending)] = True
    return tokens, mask


@dataclass(frozen=True)
class Batch:
    """Examples ready for one forward pass: R = 4 rows per example, built on the host, so that
    everything indexed by the mask is known without reading the device."""

    tokens: torch.Tensor  # (R, L) context + ending, zero-padded on the right
    scored: torch.Tensor  # (N,) flat positions r * L + t whose next token is an ending token
    targets: torch.Tensor  # (N,) that next token
    rows: torch.Tensor  # (N,) the row r of each scored position
    lengths: torch.Tensor  # (R,) ending tokens per row
    labels: torch.Tensor  # (R // 4,) the right ending of each example

    def to(self, device: torch.device) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in vars(self).values()))


def make_batch(examples: list[Example], encode, block_size: int) -> Batch:
    """Render ``examples`` into one ``Batch``; each is cut to its last ``block_size`` tokens, which
    must still hold every ending token and one token of context before them."""
    rendered = []
    for example in examples:
        tokens, mask = render(example, encode)
        tokens, mask = tokens[:, -block_size:], mask[:, -block_size:]  # (4, <=block_size)
        if mask[:, 0].any() or tokens.size(1) < 2:
            raise UserError(f"A HellaSwag example is longer than the model's block_size {block_size}.")
        rendered.append((tokens, mask))
    L = max(tokens.size(1) for tokens, _ in rendered)
    tokens = torch.cat([F.pad(t, (0, L - t.size(1))) for t, _ in rendered])  # (R, L)
    mask = torch.cat([F.pad(m, (0, L - m.size(1))) for _, m in rendered])  # (R, L)
    predicts = F.pad(mask[:, 1:], (0, 1))  # (R, L): position t predicts ending token t + 1
    rows, positions = predicts.nonzero(as_tuple=True)  # (N,), (N,)
    return Batch(
        tokens=tokens, scored=rows * L + positions, targets=tokens[rows, positions + 1], rows=rows,
        lengths=predicts.sum(dim=1), labels=torch.tensor([e.label for e in examples]),
    )


@torch.no_grad()
def ending_losses(model: GPT, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and summed cross-entropy (R,) of each row's ending tokens, each predicted from all
    before it. Logits are computed at the scored positions only (``GPT.logits_at``)."""
    R = batch.tokens.size(0)
    logits = model.logits_at(batch.tokens, batch.scored)  # (N, V)
    losses = F.cross_entropy(logits.float(), batch.targets, reduction="none")  # (N,)
    summed = torch.zeros(R, device=losses.device).index_add_(0, batch.rows, losses)  # (R,)
    return summed / batch.lengths, summed


def batches(examples: Iterable[Example], encode, block_size: int, batch_size: int) -> Iterator[Batch]:
    """``examples`` in batches of ``batch_size`` (the last may be smaller)."""
    examples = iter(examples)
    while chunk := list(itertools.islice(examples, batch_size)):
        yield make_batch(chunk, encode, block_size)


@torch.no_grad()
def count_correct(model: GPT, batches: Iterable[Batch | None], device: torch.device,
                  autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> torch.Tensor:
    """Counts (3,) on ``device``: right by mean loss (``acc_norm``), right by summed loss (``acc``),
    examples; each pass under a fresh ``autocast()``. A ``None`` batch is a pass left uncounted, so
    that every FSDP rank runs as many (each all-gathers the weights)."""
    counts = torch.zeros(3, dtype=torch.long, device=device)
    last = None
    for batch in batches:
        counted = batch is not None
        batch = (batch or last).to(device)
        last = batch
        # Eager, even when the model is compiled for the training shapes: every batch has its own length.
        with torch.compiler.set_stance("force_eager"), autocast():
            mean, summed = ending_losses(model, batch)
        if counted:
            labels = batch.labels
            counts[0] += (mean.view(-1, 4).argmin(dim=1) == labels).sum()
            counts[1] += (summed.view(-1, 4).argmin(dim=1) == labels).sum()
            counts[2] += labels.numel()
    return counts


def evaluate(model: GPT, examples: Iterator[Example], encode, device: torch.device, limit: int | None = None,
             batch_size: int = 8) -> dict:
    """``acc_norm`` (mean loss), ``acc`` (summed loss) and the example count, under bf16 autocast
    on CUDA, with ``batch_size`` examples per forward pass. The counts are read once, at the end."""
    if batch_size < 1:
        raise UserError(f"--batch_size must be at least 1, got {batch_size}.")
    model = model.to(device).eval()
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else contextlib.nullcontext
    chosen = itertools.islice(examples, limit)
    correct_norm, correct, n = count_correct(model, batches(chosen, encode, model.config.block_size, batch_size),
                                             device, autocast).tolist()  # the one read back
    if n == 0:
        raise UserError("The HellaSwag file holds no examples.")
    return {"acc_norm": correct_norm / n, "acc": correct / n, "examples": n}


class HellaSwagEval(Callback):
    """Score the model being trained on HellaSwag at step 0, every ``every_n_steps`` optimizer steps
    and at the end, logging ``eval/hellaswag_acc_norm`` and ``eval/hellaswag_acc``; each rank scores
    its share. Any ``Trainer`` whose module holds a ``GPT`` as ``.model``. Without the file it says
    once where to put it and logs nothing: it never downloads.

    Args:
        data_file: ``hellaswag_val.jsonl``. None: the copy in the cache, where
            ``gpt-lightning eval --task hellaswag`` downloads it
            (``$GPT_LIGHTNING_CACHE_DIR/hellaswag/hellaswag_val.jsonl``).
        every_n_steps: optimizer steps between evaluations.
        limit: score only the first N examples (None: all 10,042).
        batch_size: examples per forward pass (4 rows each).
    """

    def __init__(self, data_file: str | None = None, every_n_steps: int = 250, limit: int | None = None,
                 batch_size: int = 8) -> None:
        for name, value in (("every_n_steps", every_n_steps), ("limit", limit), ("batch_size", batch_size)):
            if value is not None and value < 1:
                raise UserError(f"HellaSwagEval {name} must be at least 1, got {value}.")
        self.data_file = data_file
        self.every_n_steps = every_n_steps
        self.limit = limit
        self.batch_size = batch_size
        self.examples: list[Example] | None = None
        self.evaluated_at: int | None = None
        self.results: list[dict] = []  # step, acc_norm, acc, examples (all ranks), examples_here (this rank)
        # Wall seconds of each pass, in results' order: ThroughputMonitor takes them out of the step they ran in.
        self.durations: list[float] = []

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        path = Path(self.data_file).expanduser() if self.data_file else cached_file(default_cache_dir())
        if not path.is_file():
            rank_zero_warn(
                f"HellaSwag evaluation is off: {path} does not exist. To score the model on it during "
                f"training, download {VAL_URL} there (or run `gpt-lightning eval --task hellaswag` once online)."
            )
            return
        self.examples = list(itertools.islice(read_examples(path), self.limit))
        if not self.examples:
            raise UserError(f"HellaSwag file {path} holds no examples.")
        rank_zero_info(f"HellaSwag: {len(self.examples)} examples from {path}, every {self.every_n_steps} steps.")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self._evaluate(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._evaluate(trainer, pl_module)

    def _evaluate(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = trainer.global_step
        if self.examples is None or self.evaluated_at == step:  # once a step, not once per micro-batch
            return
        self.evaluated_at = step
        if pl_module.device.type == "cuda":  # the pass's time starts once the queued training work is done
            torch.cuda.synchronize(pl_module.device)
        began = time.perf_counter()
        model = getattr(pl_module, "model", pl_module)
        encode = gpt2_encoding().encode_ordinary
        rank, world = trainer.global_rank, trainer.world_size
        mine = self.examples[rank::world]
        most = -(-len(self.examples[0::world]) // self.batch_size)  # forward passes of rank 0, the busiest
        own = list(batches(mine, encode, model.config.block_size, self.batch_size))
        padded = own + [None] * (most - len(own))  # every rank runs as many forward passes
        was_training = pl_module.training
        pl_module.eval()
        try:
            counts = count_correct(model, padded, pl_module.device, trainer.precision_plugin.forward_context)
        finally:
            pl_module.train(was_training)
        correct_norm, correct, n = trainer.strategy.reduce(counts, reduce_op="sum").tolist()
        result = {"step": step, "acc_norm": correct_norm / n, "acc": correct / n, "examples": n, "examples_here": len(mine)}
        self.results.append(result)
        for logger in trainer.loggers:
            logger.log_metrics({"eval/hellaswag_acc_norm": result["acc_norm"], "eval/hellaswag_acc": result["acc"]}, step=step)
        rank_zero_info(f"step {step}: hellaswag acc_norm {result['acc_norm']:.4f}, acc {result['acc']:.4f} over {n} examples")
        self.durations.append(time.perf_counter() - began)  # ends on a host read (the counts): the device is done too
