"""Work items to GPT-2 ids on every core, yielded in the items' order, at most ``2 x workers + 1`` in flight."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from gpt_lightning.data.documents import WorkItem
from gpt_lightning.data.tokenizer import gpt2_encoding
from gpt_lightning.errors import UserError

TOKEN_DTYPE = np.uint16  # GPT-2's 50257 ids fit in 16 bits: half the size of int32 (the cache and shards store it)


def default_workers() -> int:
    """The cores this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def encode_item(item: WorkItem) -> np.ndarray:
    """One item's ids: each document (a JSONL line, a piece that starts one) begins with ``<|endoftext|>``."""
    encoding = gpt2_encoding()
    eot = encoding.eot_token
    ids: list[int] = []
    for line in item.lines:
        try:
            text = json.loads(line)[item.text_key]
            if not isinstance(text, str):
                raise TypeError(f"{item.text_key!r} holds a {type(text).__name__}")
        except (ValueError, KeyError, TypeError) as err:
            raise UserError(
                f"{item.source}: a line is not a JSON object with a {item.text_key!r} string "
                f"({type(err).__name__}: {err}); name the text field with --text_key."
            ) from None
        if text:
            ids.append(eot)
            ids += encoding.encode_ordinary(text)
    for starts_document, text in item.pieces:
        if starts_document:
            ids.append(eot)
        ids += encoding.encode_ordinary(text)
    return np.array(ids, dtype=TOKEN_DTYPE)


def _default_sigterm() -> None:
    """In each pool worker, forked with SIGTERM blocked: die on ``Pool.terminate``'s SIGTERM."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _start_pool(context: Any, workers: int) -> Any:
    """A pool of ``workers`` whose forked workers start with SIGTERM blocked until ``_default_sigterm``
    makes it fatal, so no handler inherited from the parent (Lightning's) can leave the pool waiting."""
    fork = context.get_start_method() == "fork"
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}) if fork else None
    try:
        return context.Pool(workers, initializer=_default_sigterm if fork else None)
    finally:
        if fork:  # a SIGTERM that came meanwhile reaches this process's handler now
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def encode_items(items: Iterable[WorkItem], workers: int) -> Iterator[tuple[int, np.ndarray]]:
    """Each item's input position (``WorkItem.position``) and ids, in the items' order. ``workers`` 1
    encodes in this process."""
    if workers <= 1:
        for item in items:
            yield item.position, encode_item(item)
        return
    # fork where it is the default (Linux): workers start at once with the encoding already loaded.
    context = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else None)
    gpt2_encoding()
    with _start_pool(context, workers) as pool:
        pending: deque = deque()  # (position, result), oldest first: results leave in order
        for item in items:
            pending.append((item.position, pool.apply_async(encode_item, (item,))))
            if len(pending) > 2 * workers:
                position, result = pending.popleft()
                yield position, result.get()
        while pending:
            position, result = pending.popleft()
            yield position, result.get()


class Progress:
    """One line, rewritten in place: bytes read of the total, tokens, tokens/s and the time left."""

    def __init__(self, total_bytes: int, enabled: bool = True, stream=None) -> None:
        self.total, self.enabled, self.stream = total_bytes, enabled, stream or sys.stderr
        self.start = self.last = time.perf_counter()
        self.tokens = 0

    def update(self, tokens: int, bytes_done: int, force: bool = False) -> None:
        self.tokens += tokens
        now = time.perf_counter()
        if not self.enabled or (now - self.last < 0.5 and not force):
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        rate = self.tokens / elapsed
        left = (self.total - bytes_done) / (bytes_done / elapsed) if bytes_done else float("inf")
        eta = "?" if left == float("inf") else time.strftime("%H:%M:%S", time.gmtime(left))
        share = 100 * bytes_done / self.total if self.total else 100.0
        self.stream.write(
            f"\rtokenizing: {share:5.1f}% of {self.total / 1e6:,.1f} MB, {self.tokens:,} tokens, "
            f"{rate / 1e6:.2f}M tokens/s, ETA {eta}   "
        )
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.update(0, self.total, force=True)
            self.stream.write("\n")
