"""HellaSwag, scored the standard way for GPT-2: for each of the 4 endings, the mean cross-entropy
of the ending's tokens given the context; the lowest wins (``acc_norm``, as build-nanogpt reports:
29.55% for OpenAI's 124M). ``acc`` uses the summed cross-entropy instead.

The validation file (``hellaswag_val.jsonl``, 10,042 examples) is downloaded once into the cache
when online, or given as a local path.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
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


def validation_file(cache_dir: Path) -> Path:
    """The cached ``hellaswag_val.jsonl``, downloaded once when it is not there yet."""
    path = cache_dir / "hellaswag" / "hellaswag_val.jsonl"
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


@torch.no_grad()
def ending_losses(model: GPT, tokens: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and summed cross-entropy (4,) of each ending's tokens, each predicted from all before it."""
    logits, _ = model(tokens)  # (4, L, V)
    losses = F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none"
    ).view(tokens.size(0), -1)  # (4, L-1): loss of predicting token t+1 at position t
    ending = mask[:, 1:].float()  # (4, L-1)
    summed = (losses * ending).sum(dim=1)
    return summed / ending.sum(dim=1), summed


def evaluate(model: GPT, examples: Iterator[Example], encode, device: torch.device, limit: int | None = None) -> dict:
    """``acc_norm`` (mean loss), ``acc`` (summed loss) and the example count."""
    model = model.to(device).eval()
    n = correct_norm = correct = 0
    for example in examples:
        if limit is not None and n >= limit:
            break
        tokens, mask = render(example, encode)
        # Longer than the model's table: keep the last block_size tokens, which must still hold
        # every ending token and one token of context before them.
        tokens, mask = tokens[:, -model.config.block_size :], mask[:, -model.config.block_size :]
        if mask[:, 0].any() or tokens.size(1) < 2:
            raise UserError(f"A HellaSwag example is longer than the model's block_size {model.config.block_size}.")
        mean, summed = ending_losses(model, tokens.to(device), mask.to(device))
        by_mean, by_sum = torch.stack((mean.argmin(), summed.argmin())).tolist()  # one read back
        correct_norm += by_mean == example.label
        correct += by_sum == example.label
        n += 1
    if n == 0:
        raise UserError("The HellaSwag file holds no examples.")
    return {"acc_norm": correct_norm / n, "acc": correct / n, "examples": n}
