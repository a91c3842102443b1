"""``TokenWindows``: epochs of ``(B, T)`` windows over a token array per rank, shuffled on request,
resumable through Lightning's stateful-loader protocol, on another number of processes too."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import IterableDataset

from gpt_lightning.errors import UserError

Batch = tuple[torch.Tensor, torch.Tensor]


class ResumableStream(IterableDataset):
    """An epoch of rows (``T + 1`` tokens each) in an order fixed by the data, the seed and the epoch; batch
    ``i`` of ``rank`` holds rows ``(i * world_size + rank) * B`` on, and the position saved counts rows, so a
    resume on another layout goes on (docs/resume.md). ``progress``: under a trainer, ``(epoch, batches of it
    done)`` when a pass starts (None: each ``iter()`` is the next epoch); ``moved(batches_done,
    saved_accumulate, ended)`` tells the trainer this layout's counts after such a resume."""

    def __init__(
        self,
        batch_size: int,
        block_size: int,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = False,
        progress: Callable[[], tuple[int, int]] | None = None,
        accumulate: int = 1,
        moved: Callable[[int, int, bool], None] | None = None,
    ) -> None:
        self.batch_size, self.block_size = batch_size, block_size
        self.rank, self.world_size = rank, world_size
        self.shuffle = shuffle
        self.progress = progress
        self.accumulate = accumulate
        self.moved = moved
        self._epoch: int | None = None  # epoch of the pass being served; None before the first
        self._served = 0  # batches of that epoch served
        self._offset = 0  # the row batch 0 of the epoch begins at
        self._restored: dict[str, Any] | None = None

    # Subclasses define segment_rows() (each segment's rows: a text's, a shard's), segment_tokens(segment),
    # segment_order(epoch) and row_order(segment, epoch) (None: in order), and order(), the settings that fix it.

    @property
    def rows_per_batch(self) -> int:
        return self.world_size * self.batch_size

    def available(self) -> int:
        return sum(self.segment_rows()) // self.rows_per_batch

    def __len__(self) -> int:
        return self.available() // self.accumulate * self.accumulate

    def layout(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "processes": self.world_size, "accumulate": self.accumulate}

    def batches(self, epoch: int, start: int, offset: int = 0) -> Iterator[Batch]:
        """This rank's batches ``start, start + 1, ...`` of ``epoch``, batch 0 beginning at row ``offset``."""
        rows, B, W = sum(self.segment_rows()), self.batch_size, self.world_size
        order = self.segment_order(epoch)
        starts = np.cumsum([0, *(self.segment_rows()[i] for i in order)]).tolist()  # of the epoch's segments
        opened: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}  # one segment open at a time
        for index in itertools.count(start):
            first = offset + (index * W + self.rank) * B
            if offset + (index + 1) * W * B > rows:
                return
            parts = []
            row = first
            while row < first + B:  # a batch's rows may come from two segments
                k = bisect.bisect_right(starts, row) - 1
                if order[k] not in opened:
                    opened.clear()
                    opened[order[k]] = (self.segment_tokens(order[k]), self.row_order(order[k], epoch))
                n = min(first + B - row, starts[k + 1] - row)
                parts.append(self._rows(*opened[order[k]], row - starts[k], n))
                row += n
            yield parts[0] if len(parts) == 1 else (torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts]))

    def _rows(self, tokens: np.ndarray, within: np.ndarray | None, local: int, n: int) -> Batch:
        """Rows ``local .. local + n`` of a segment as ``(n, T)`` inputs and next-token targets."""
        T = self.block_size
        if within is None:  # in order: one slice (each row's last target is the next row's first input)
            buf = torch.from_numpy(tokens[local * T : (local + n) * T + 1].astype(np.int64))  # (n*T+1,)
            return buf[:-1].view(n, T), buf[1:].view(n, T)
        buf = torch.from_numpy(
            np.stack([tokens[s * T : s * T + T + 1] for s in within[local : local + n]]).astype(np.int64)
        )
        return buf[:, :-1], buf[:, 1:]  # (n, T+1) rows, each contiguous

    def __iter__(self) -> Iterator[Batch]:
        # A generator: runs at the first batch, after Lightning has restored its loops' progress.
        epoch, start, offset = self._next_pass()
        self._epoch, self._served, self._offset = epoch, start, offset
        for batch in itertools.islice(self.batches(epoch, start, offset), max(0, len(self) - start)):
            self._served += 1  # counted before the batch leaves: a checkpoint after it includes it
            yield batch

    def _next_pass(self) -> tuple[int, int, int]:
        """The epoch, the first batch and the grid's offset of the pass about to start."""
        trainer_epoch, done = self.progress() if self.progress is not None else (None, None)
        restored, self._restored = self._restored, None
        if restored is not None:
            if done is None:
                done = 0 if restored["ended"] else restored["batches"]
            if done > 0:  # the restored epoch goes on
                return restored["epoch"], done, restored["offset"]
            return restored["epoch"] + (restored["batches"] > 0 or restored["ended"]), 0, 0  # it had ended
        if self._epoch is None:  # a fresh start (or a checkpoint without a stream state: the trainer's word)
            return trainer_epoch or 0, done or 0, 0
        return self._epoch + 1, done or 0, 0

    def state_dict(self) -> dict[str, Any]:
        if self._restored is not None:  # restored but not served yet: pass the position on unchanged
            return dict(self._restored["state"])
        steps = self._served // self.accumulate  # whole optimizer steps: a resume reads an unfinished one again
        return {
            "epoch": self._epoch or 0,
            "batches": self._served,
            "ended": self._served >= len(self),
            "rows": self._offset + steps * self.accumulate * self.rows_per_batch,
            "layout": self.layout(),
            "order": self.order(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        epoch, batches = int(state_dict["epoch"]), int(state_dict["batches"])
        restored = {"epoch": epoch, "batches": batches, "offset": 0, "ended": batches >= len(self), "state": state_dict}
        layout, order = state_dict.get("layout"), state_dict.get("order")
        if not isinstance(layout, dict) or order is None:
            raise UserError(
                "The checkpoint's data position was written by a gpt-lightning before 0.1.0, which this one does "
                "not read: start a new run (model.init_from takes the weights of an export)."
            )
        ended, rows = bool(state_dict["ended"]), int(state_dict["rows"])
        self._check_order(order, rows, ended or rows == 0)
        if layout == self.layout():
            steps = batches // self.accumulate
            restored.update(ended=ended, offset=rows - steps * self.accumulate * self.rows_per_batch)
        else:  # another layout: go on from row ``rows`` in whole steps of this one, telling ``moved``
            left = 0 if ended else max(0, (sum(self.segment_rows()) - rows) // (self.accumulate * self.rows_per_batch))
            done = len(self) - left * self.accumulate  # batches of the epoch this layout counts as done
            restored.update(batches=done, ended=left == 0, offset=rows - done * self.rows_per_batch)
            if self.moved is not None:
                self.moved(done, int(layout["accumulate"]), left == 0)
        self._restored = restored

    def _check_order(self, order: dict[str, Any], rows: int, at_epoch_start: bool) -> None:
        """Refuse a mid-epoch resume whose rows would come in another order; warn where the data changed."""
        if at_epoch_start:
            return
        now = self.order()
        changed = [key for key in ("block_size", "shuffle", "seed") if order.get(key) != now[key]]
        if changed:
            names = " ".join(f"--data.{key} {order.get(key)}" for key in changed)
            raise UserError(
                f"The checkpoint stopped mid-epoch in the order of rows that {names} give (this run: "
                f"{', '.join(f'{key} {now[key]}' for key in changed)}); the rest of that epoch exists in that order "
                f"only: resume with {names}, or from a checkpoint saved at an epoch's end."
            )
        if order.get("rows") != now["rows"]:
            rank_zero_warn(
                f"The training data changed since the checkpoint ({sum(order['rows'])} rows of {now['block_size']} "
                f"tokens, now {sum(now['rows'])}): the resumed epoch goes on from row {rows} of the new data."
            )


class TokenWindows(ResumableStream):
    """Epochs of contiguous ``(batch_size, block_size)`` windows of ``tokens`` (1-D ids, a memory map is
    fine); ``seed`` with the epoch fixes the shuffled order. The other arguments: ``ResumableStream``'s."""

    def __init__(self, tokens: np.ndarray, *args: Any, seed: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tokens = tokens
        self.seed = seed
        self.rows = max(0, (len(tokens) - 1) // self.block_size)  # every row of T + 1 tokens (targets shifted by one)

    def segment_rows(self) -> list[int]:
        return [self.rows]

    def segment_tokens(self, segment: int) -> np.ndarray:
        return self.tokens

    def segment_order(self, epoch: int) -> list[int]:
        return [0]

    def row_order(self, segment: int, epoch: int) -> np.ndarray | None:
        return np.random.default_rng([self.seed, epoch]).permutation(self.rows) if self.shuffle else None

    def order(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "shuffle": self.shuffle, "seed": self.seed, "rows": self.segment_rows()}
