"""Running lm-evaluation-harness tasks on a ``GPTHarnessLM``: the harness's tasks, prompts, few-shot
examples, metrics and results dict, with its errors for a missing install or dataset said in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpt_lightning.errors import UserError

INSTALL_HINT = 'pip install "gpt-lightning[eval]"'


def import_lm_eval():
    """The ``lm_eval`` package, or a one-line ``UserError`` saying how to install it."""
    try:
        import lm_eval
    except ImportError:
        raise UserError(f"Harness tasks need lm-evaluation-harness, which is not installed: {INSTALL_HINT}") from None
    return lm_eval


def run_tasks(
    lm: Any,
    tasks: list[str],
    *,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    include_path: str | Path | None = None,
    log_samples: bool = False,
    bootstrap_iters: int = 100_000,
) -> dict[str, Any]:
    """The harness's results dict (``results``, ``groups``, ``configs``, ... and with ``log_samples``
    ``samples``) of ``lm`` on ``tasks``.

    Args:
        lm: the model, an ``lm_eval`` ``LM`` (a ``GPTHarnessLM``).
        tasks: task, group or tag names, or paths of task YAMLs.
        num_fewshot: examples in each prompt; None keeps each task's own.
        limit: score only the first N examples of each task (a fraction below 1: that share).
        include_path: a folder of the user's task YAMLs, found beside the harness's own.
        log_samples: keep each request's inputs and outputs in ``samples``.
        bootstrap_iters: resamples for the metrics' standard errors (the harness's default); 0 skips them.
    """
    lm_eval = import_lm_eval()
    from lm_eval.tasks import TaskManager

    task_manager = None
    if include_path is not None:  # the user's own tasks alone skip indexing the harness's ~14,000 YAMLs (~30 s)
        task_manager = TaskManager(include_path=str(include_path), include_defaults=False)
        if not all(name in task_manager.all_tasks for name in tasks):
            task_manager = None
    if task_manager is None:
        task_manager = TaskManager(include_path=str(include_path) if include_path is not None else None)
    unknown = [name for name in tasks if name not in task_manager.all_tasks and not Path(name).is_file()]
    if unknown:
        hint = f" in the harness or in {include_path}" if include_path is not None else " (give --include_path for your own YAMLs)"
        raise UserError(f"Unknown task {', '.join(unknown)}{hint}: `lm-eval ls tasks` lists the harness's.")
    try:
        results = lm_eval.simple_evaluate(
            model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit, log_samples=log_samples,
            bootstrap_iters=bootstrap_iters, task_manager=task_manager, batch_size=getattr(lm, "batch_size", None),
        )
    except Exception as err:
        if _is_offline_error(err):
            raise UserError(
                f"A task's dataset is not in the Hugging Face cache and cannot be downloaded ({type(err).__name__}): "
                "run once with network, or give --include_path task YAMLs on local files (docs/evaluation.md)."
            ) from None
        raise
    return results


def _is_offline_error(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is how ``datasets``/``huggingface_hub`` say a download failed."""
    names = ("ConnectionError", "ConnectTimeout", "OfflineModeIsEnabled", "LocalEntryNotFoundError",
             "DatasetNotFoundError", "MaxRetryError", "NameResolutionError", "HfHubHTTPError")
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if any(cls.__name__ in names for cls in type(err).__mro__):
            return True
        err = err.__cause__ or err.__context__
    return False
