"""``HarnessEval``: lm-evaluation-harness tasks on the model being trained, every N steps (docs/evaluation.md)."""

from __future__ import annotations

import functools
import random
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from gpt_lightning.errors import UserError
from gpt_lightning.evaluation.periodic import PeriodicEvaluation
from gpt_lightning.evaluation.tasks import import_lm_eval, is_offline_error, quiet_git_probe, task_manager


class HarnessEval(PeriodicEvaluation):
    """Score the model being trained on lm-evaluation-harness tasks at step 0, every ``every_n_steps``
    optimizer steps and at the end, logged as ``eval/<task>/<metric>``. One device or DDP, not FSDP2.

    Args:
        tasks: task, group or tag names, as a list or comma-separated (``gpt2-suite`` included).
        every_n_steps: optimizer steps between evaluations.
        limit: score only the first N examples of each task (None: all of them).
        num_fewshot: examples in each prompt; None keeps each task's own.
        include_path: a folder of your own task YAMLs (e.g. on local data files, for no network).
        batch_size: requests per forward pass.
    """

    def __init__(
        self,
        tasks: list[str] | str,
        every_n_steps: int = 500,
        limit: int | None = None,
        num_fewshot: int | None = None,
        include_path: str | None = None,
        batch_size: int = 8,
    ) -> None:
        import_lm_eval()  # a one-line error now, if the harness is not installed
        if isinstance(tasks, str):
            tasks = [name.strip() for name in tasks.split(",") if name.strip()]
        if not tasks:
            raise UserError("HarnessEval needs at least one task.")
        super().__init__(every_n_steps, limit, batch_size)
        self.tasks = list(tasks)
        self.num_fewshot = num_fewshot
        self.include_path = include_path
        self.results: list[dict[str, Any]] = []  # {"step": ..., "eval/<task>/<metric>": value, ...}, every rank
        self._task_manager: Any = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self._task_manager is not None:
            return
        if pl_module.device_mesh is not None:
            raise UserError(
                "HarnessEval does not run under ModelParallelStrategy (FSDP2): use DDP, or "
                "`gpt-lightning eval --tasks` on a checkpoint."
            )
        if self.limit is not None and self.limit < trainer.world_size:  # a rank with no example fails in the harness
            raise UserError(
                f"HarnessEval limit {self.limit} is below the {trainer.world_size} ranks: give each rank "
                "an example at least (limit >= the number of processes)."
            )
        self._task_manager = task_manager(self.tasks, self.include_path)
        try:  # every dataset now, not after hours of training
            loaded = self._task_manager.load(self.tasks)
        except Exception as err:
            if is_offline_error(err):
                raise UserError(
                    f"HarnessEval: a dataset of {', '.join(self.tasks)} is not in the Hugging Face cache and cannot be "
                    "downloaded. Run once with network, or give include_path task YAMLs on local files (docs/evaluation.md)."
                ) from None
            raise
        for name, task in loaded["tasks"].items():  # the same failure, for a task with fewer examples than ranks
            examples = len(task.eval_docs) if self.limit is None else min(self.limit, len(task.eval_docs))
            if examples < trainer.world_size:
                raise UserError(
                    f"HarnessEval: task {name} has {examples} example(s), fewer than the {trainer.world_size} "
                    "ranks, and a rank without one fails in the harness: give it more examples, or score it "
                    "with `gpt-lightning eval --tasks` on a checkpoint."
                )
        rank_zero_info(
            f"HarnessEval: {', '.join(self.tasks)} every {self.every_n_steps} steps"
            + (f", {self.limit} examples each." if self.limit else ".")
        )

    def evaluate(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = trainer.global_step
        model = getattr(pl_module, "model", pl_module)
        lm = ranked_lm_class()(model, trainer.strategy, batch_size=self.batch_size, device=pl_module.device)
        saved = random.getstate(), np.random.get_state()  # the harness seeds them; training goes on as it was
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        try:
            with (
                torch.random.fork_rng(devices=cuda),
                torch.no_grad(),
                torch.compiler.set_stance("force_eager"),
                trainer.precision_plugin.forward_context(),
                quiet_git_probe(),
            ):
                results = import_lm_eval().simple_evaluate(
                    model=lm,
                    tasks=self.tasks,
                    num_fewshot=self.num_fewshot,
                    limit=self.limit,
                    task_manager=self._task_manager,
                    log_samples=False,
                    bootstrap_iters=0,  # no standard errors
                )
        finally:
            random.setstate(saved[0])
            np.random.set_state(saved[1])
        metrics = trainer.strategy.broadcast(logged_metrics(results) if results is not None else None, src=0)
        self.results.append({"step": step, **metrics})
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)
        rank_zero_info(f"step {step}: " + ", ".join(f"{name[5:]} {value:.4f}" for name, value in metrics.items()))


def logged_metrics(results: dict[str, Any]) -> dict[str, float]:
    """``eval/<task>/<metric>`` (``<metric>_<filter>`` for a filter other than ``none``) of the harness's
    results dict, no standard errors; and ``eval/<task>/samples``, the examples scored."""
    metrics = {}
    for task, values in results["results"].items():
        if "sample_len" in values:
            metrics[f"eval/{task}/samples"] = float(values["sample_len"])
        for key, value in values.items():
            metric, comma, filter_name = key.partition(",")  # "acc,none": a metric and its filter
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if comma and number and not metric.endswith("_stderr"):
                name = metric if filter_name == "none" else f"{metric}_{filter_name}"
                metrics[f"eval/{task}/{name}"] = float(value)
    return metrics


@functools.cache
def ranked_lm_class() -> type:
    """``GPTHarnessLM`` with the harness's data-parallel hooks on a Lightning ``Strategy`` (built on first
    use: the harness is an optional extra)."""
    from gpt_lightning.evaluation.harness_model import GPTHarnessLM

    class RankedHarnessLM(GPTHarnessLM):
        def __init__(self, model: torch.nn.Module, strategy: Strategy, **kwargs: Any) -> None:
            super().__init__(model, **kwargs)
            self._rank, self._world_size = strategy.global_rank, strategy.world_size

        def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
            gathered = [torch.empty_like(tensor) for _ in range(self._world_size)]
            torch.distributed.all_gather(gathered, tensor)  # no barrier first, unlike Strategy.all_gather
            return torch.stack(gathered).reshape(-1)  # (world_size,) of a scalar

        def gather_object(self, obj: Any, dst: int = 0) -> list | None:
            gathered = [None] * self._world_size if self._rank == dst else None
            torch.distributed.gather_object(obj, gathered, dst=dst)
            return gathered

        def barrier(self) -> None:
            """Nothing: the gathers that follow each barrier of the harness wait for every rank anyway."""

    return RankedHarnessLM
