"""Running lm-evaluation-harness tasks on a ``GPTHarnessLM``, a missing install or dataset said in one line."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Any
from unittest import mock

from gpt_lightning.errors import UserError
from gpt_lightning.evaluation.suite import SUITE_DIR

INSTALL_HINT = 'pip install "gpt-lightning[eval]"'


def import_lm_eval():
    """The ``lm_eval`` package, or a one-line ``UserError`` saying how to install it."""
    try:
        import lm_eval
    except ImportError:
        raise UserError(f"Harness tasks need lm-evaluation-harness, which is not installed: {INSTALL_HINT}") from None
    return lm_eval


def task_manager(tasks: list[str], include_path: str | Path | None = None) -> Any:
    """The harness's ``TaskManager`` over its own tasks, this package's suite (``gpt2-suite``) and
    ``include_path``; a ``UserError`` naming any task it does not know."""
    import_lm_eval()
    from lm_eval.tasks import TaskManager

    paths = [str(SUITE_DIR)] + ([str(include_path)] if include_path is not None else [])
    # The user's own plain tasks skip indexing the harness's YAMLs (~30 s); anything else needs the index.
    manager = TaskManager(include_path=paths, include_defaults=False)
    if not all(name in manager.all_subtasks for name in tasks):
        manager = TaskManager(include_path=paths)
    unknown = [name for name in tasks if not manager.match_tasks([name]) and not Path(name).is_file()]
    if unknown:
        hint = " (give --include_path for your own YAMLs)" if include_path is None else f" in {include_path}"
        raise UserError(f"Unknown task {', '.join(unknown)}{hint}: `lm-eval ls tasks` lists the harness's.")
    return manager


def run_tasks(
    lm: Any,
    tasks: list[str],
    *,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    include_path: str | Path | None = None,
    log_samples: bool = False,
    bootstrap_iters: int = 100_000,
    gen_kwargs: dict[str, Any] | None = None,
    seeds: list[int | None] | None = None,
    use_cache: str | None = None,
) -> dict[str, Any] | None:
    """The harness's ``simple_evaluate`` results dict of ``lm`` on ``tasks`` (None on ranks other than 0);
    the options are ``gpt-lightning eval``'s, ``seeds`` its ``--seed``'s four values."""
    lm_eval = import_lm_eval()
    manager = task_manager(tasks, include_path)
    seeded = dict(zip(("random_seed", "numpy_random_seed", "torch_random_seed", "fewshot_random_seed"), seeds or ()))
    try:
        with quiet_git_probe():
            results = lm_eval.simple_evaluate(
                model=lm,
                tasks=list(tasks),
                num_fewshot=num_fewshot,
                limit=limit,
                log_samples=log_samples,
                bootstrap_iters=bootstrap_iters,
                task_manager=manager,
                batch_size=getattr(lm, "batch_size", None),
                gen_kwargs=gen_kwargs,
                use_cache=use_cache,
                **seeded,
            )
    except Exception as err:
        if is_offline_error(err):
            said = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(
                f"A task's dataset is not in the Hugging Face cache and cannot be downloaded ({said}). Run once with "
                "network to cache it, or give --include_path task YAMLs on local files (docs/evaluation.md)."
            ) from None
        raise
    return results


def quiet_git_probe() -> contextlib.AbstractContextManager:
    """The harness's ``git describe`` probe for its results, without its ``fatal: not a git repository``."""
    from lm_eval import evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def commit_hash() -> str | None:
        try:
            return subprocess.check_output(
                ["git", "describe", "--always"], stderr=subprocess.DEVNULL, text=True
            ).strip()
        except (subprocess.CalledProcessError, FileNotFoundError):  # not a repository, or no git installed
            return get_commit_from_path(os.getcwd())

    return mock.patch.object(evaluator, "get_git_commit_hash", commit_hash)


def is_offline_error(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is how ``datasets``/``huggingface_hub`` say a download failed."""
    names = (
        "ConnectionError",
        "ConnectTimeout",
        "OfflineModeIsEnabled",
        "LocalEntryNotFoundError",
        "DatasetNotFoundError",
        "MaxRetryError",
        "NameResolutionError",
        "HfHubHTTPError",
    )
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if any(cls.__name__ in names for cls in type(err).__mro__):
            return True
        err = err.__cause__ or err.__context__
    return False
