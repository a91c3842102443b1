"""HellaSwag scored build-nanogpt's way: the ending of lowest mean cross-entropy wins (``acc_norm``;
``acc`` sums), several examples per forward pass; how this differs from the harness's: docs/hellaswag.md."""

from __future__ import annotations

import contextlib
import itertools
import json
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from gpt_lightning.atomic import atomic_write_bytes
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
        raise UserError(
            f"The file downloaded from {VAL_URL} has {lines} lines, not {VAL_EXAMPLES}; nothing was cached."
        )
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
    """Examples ready for one forward pass, R = 4 rows per example, built on the host (no device read)."""

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
        tokens=tokens,
        scored=rows * L + positions,
        targets=tokens[rows, positions + 1],
        rows=rows,
        lengths=predicts.sum(dim=1),
        labels=torch.tensor([e.label for e in examples]),
    )


@torch.no_grad()
def ending_losses(model: GPT, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and summed cross-entropy (R,) of each row's ending tokens, logits at those positions only."""
    logits = model.logits_at(batch.tokens, batch.scored)  # (N, V)
    losses = F.cross_entropy(logits.float(), batch.targets, reduction="none")  # (N,)
    summed = losses.new_zeros(batch.tokens.size(0)).index_add_(0, batch.rows, losses)  # (R,)
    return summed / batch.lengths, summed


def batches(examples: Iterable[Example], encode, block_size: int, batch_size: int) -> Iterator[Batch]:
    examples = iter(examples)
    while chunk := list(itertools.islice(examples, batch_size)):
        yield make_batch(chunk, encode, block_size)


@torch.no_grad()
def count_correct(
    model: GPT,
    batches: Iterable[Batch | None],
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> torch.Tensor:
    """Counts (3,) on ``device``: right by mean loss (``acc_norm``), by summed loss (``acc``), examples.
    A ``None`` batch is an uncounted pass, so every FSDP rank runs as many."""
    counts = torch.zeros(3, dtype=torch.long, device=device)
    last = None
    for batch in batches:
        counted = batch is not None
        batch = (batch or last).to(device)
        last = batch
        with torch.compiler.set_stance("force_eager"), autocast():
            mean, summed = ending_losses(model, batch)
        if counted:
            labels = batch.labels
            counts[0] += (mean.view(-1, 4).argmin(dim=1) == labels).sum()
            counts[1] += (summed.view(-1, 4).argmin(dim=1) == labels).sum()
            counts[2] += labels.numel()
    return counts


def evaluate(
    model: GPT,
    examples: Iterator[Example],
    encode,
    device: torch.device,
    limit: int | None = None,
    batch_size: int = 8,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> dict:
    """``acc_norm`` (mean loss), ``acc`` (summed loss) and the example count, with ``batch_size`` examples
    per forward pass, each under ``autocast()``. The counts are read once, at the end."""
    model = model.to(device).eval()
    chosen = itertools.islice(examples, limit)
    correct_norm, correct, n = count_correct(
        model, batches(chosen, encode, model.config.block_size, batch_size), device, autocast
    ).tolist()  # the one read back
    if n == 0:
        raise UserError("The HellaSwag file holds no examples.")
    return {"acc_norm": correct_norm / n, "acc": correct / n, "examples": n}
