"""``data.tokens_per_step_schedule``: tokens per optimizer step that change at given steps (a batch
size growing over training, as modded-nanogpt's records grow it), realised as the number of
micro-batches Lightning accumulates per step. docs/data.md, "Tokens per step that grow".

Lightning ends an accumulation where ``batches of the epoch % accumulate_grad_batches == 0`` and zeroes
the gradients where ``batch index % accumulate_grad_batches == 0``. Setting ``accumulate_grad_batches``
to the step's accumulation at each step's first micro-batch therefore gives exactly the schedule's
steps if every step starts at a count of the epoch's batches that its accumulation divides. That holds
when (1) every stage but the last trains a multiple of ``unit`` micro-batches, ``unit`` the least
common multiple of the accumulations, and (2) every epoch is a multiple of ``unit`` micro-batches
(the data module trims it so): then every epoch starts at a multiple of ``unit`` of the run's
micro-batches, and in a stage of accumulation ``a`` (which divides ``unit``) every step starts ``a``
micro-batches after the last, from a multiple of ``unit``.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from gpt_lightning.errors import UserError

NAME = "data.tokens_per_step_schedule"


def check_schedule(schedule: object) -> list[tuple[int, int]]:
    """The schedule as ``[(first step, tokens per step), ...]``, or a ``UserError`` saying what is wrong."""
    example = f"e.g. {NAME} [[0, 65536], [1000, 131072]]"
    if not isinstance(schedule, Sequence) or isinstance(schedule, str) or not schedule:
        raise UserError(f"{NAME} must be a non-empty list of [step, tokens] pairs, {example}; got {schedule!r}.")
    stages = []
    for pair in schedule:
        if (
            not isinstance(pair, Sequence)
            or isinstance(pair, str)
            or len(pair) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in pair)
        ):
            raise UserError(f"{NAME} must be a list of [step, tokens] pairs of integers, {example}; got {pair!r}.")
        stages.append((int(pair[0]), int(pair[1])))
    if stages[0][0] != 0:
        raise UserError(f"{NAME} must start at step 0 (its first pair is {list(stages[0])}), {example}.")
    for (before, _), (step, _) in zip(stages, stages[1:]):
        if step <= before:
            raise UserError(f"{NAME}'s steps must increase: {step} follows {before}.")
    for step, tokens in stages:
        if tokens <= 0:
            raise UserError(f"{NAME}'s tokens per step must be positive: [{step}, {tokens}].")
    return stages


def tokens_through(stages: list[tuple[int, int]], steps: int) -> int:
    """Tokens trained by the first ``steps`` optimizer steps of ``[(first step, tokens per step), ...]``."""
    ends = [start for start, _ in stages[1:]] + [steps]
    return sum(max(0, min(end, steps) - start) * tokens for (start, tokens), end in zip(stages, ends))


class AccumulationSchedule:
    """Micro-batches accumulated per optimizer step, by step: ``accumulations[i]`` from ``starts[i]`` on."""

    def __init__(self, stages: list[tuple[int, int]], micro: int, shape: str) -> None:
        """``stages`` from ``check_schedule``; ``micro`` the tokens of one micro-batch over all processes,
        ``shape`` how it is made (``"1 x 2 x 16"``), for the messages."""
        for step, tokens in stages:
            if tokens % micro:
                nearest = sorted({max(micro, tokens // micro * micro), (tokens // micro + 1) * micro})
                raise UserError(
                    f"{NAME}: {tokens:,} tokens per step (from step {step}) is not a multiple of world_size x "
                    f"batch_size x block_size = {shape} = {micro:,}. Use {' or '.join(f'{n:,}' for n in nearest)}, "
                    "or change data.batch_size."
                )
        self.starts = [step for step, _ in stages]
        self.tokens = [tokens for _, tokens in stages]
        self.accumulations = [tokens // micro for tokens in self.tokens]
        self.unit = math.lcm(*self.accumulations)
        for i in range(len(stages) - 1):
            every = self.unit // self.accumulations[i]  # steps of this stage that make whole units
            length = self.starts[i + 1] - self.starts[i]
            if length % every:
                later = self.starts[i] + (length // every + 1) * every
                earlier = [self.starts[i] + length // every * every] if length > every else []
                raise UserError(
                    f"{NAME}: the stage from step {self.starts[i]} ({self.accumulations[i]} micro-batches a step) "
                    f"lasts {length} steps, not a multiple of {every}: each stage but the last must train a "
                    f"multiple of {self.unit} micro-batches (the least common multiple of the stages' "
                    f"{', '.join(map(str, self.accumulations))}), so that every step starts where Lightning's "
                    f"accumulation can start it. Start the next stage at step "
                    f"{' or '.join(map(str, [*earlier, later]))}."
                )

    def stage(self, step: int) -> int:
        return bisect.bisect_right(self.starts, step) - 1

    def at(self, step: int) -> int:
        """Micro-batches accumulated by optimizer step ``step`` (0-based)."""
        return self.accumulations[self.stage(step)]

    def tokens_through(self, steps: int) -> int:
        """Tokens trained by the first ``steps`` optimizer steps."""
        return tokens_through(list(zip(self.starts, self.tokens)), steps)

    def describe(self) -> str:
        """``64 (x 2 micro-batches) from step 0, 128 (x 4) from step 2``."""
        return ", ".join(
            f"{tokens:,} (x {accumulate}{' micro-batches' if i == 0 else ''}) from step {start}"
            for i, (start, tokens, accumulate) in enumerate(zip(self.starts, self.tokens, self.accumulations))
        )
