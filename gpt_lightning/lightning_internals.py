"""The one place gpt-lightning reaches past Lightning's public API (and the private torch and argparse
names that go with it); none has a public equivalent. ``tests/test_lightning_internals.py`` checks each
against the installed versions and names what moved, hence ``lightning<2.7`` in pyproject.toml.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any
from unittest import mock

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI


def batches_that_stepped(trainer: Trainer) -> int:
    """The step Lightning's loggers log at."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def set_batches_that_stepped(trainer: Trainer, value: int) -> None:
    trainer.fit_loop.epoch_loop._batches_that_stepped = value


def batches_started(trainer: Trainer) -> int:
    """Batches of the current epoch the fit loop has already started (a mid-epoch resume's offset)."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.ready


def move_batch_progress(trainer: Trainer, batches: int, accumulate: int, accumulated: int, ended: bool) -> None:
    """Restored counts in another layout's micro-batches made this layout's: ``batches`` of the current
    epoch done, the earlier epochs' whole steps of ``accumulated`` counted at ``accumulate``."""
    progress = trainer.fit_loop.epoch_loop.batch_progress
    current, total = progress.current, progress.total
    earlier = (total.ready - current.ready) // accumulated * accumulate
    for counts, base in ((total, earlier), (current, 0)):  # total first: it reads current's old counts
        lags = {name: current.ready - getattr(current, name) for name in ("started", "processed", "completed")}
        counts.ready = base + batches
        for name, lag in lags.items():  # a checkpoint saved mid-batch keeps its place in the batch
            setattr(counts, name, max(base, base + batches - lag))
    progress.is_last_batch = ended


def mark_step_saved(checkpoint: Any, step: int) -> None:
    """Tell a ``ModelCheckpoint`` that ``step`` is saved already. It keeps this in memory only, so after a resume at
    a multiple of ``every_n_train_steps`` it would save that step again at the end of the first micro-batch: under
    gradient accumulation, mid-step (Lightning-AI/pytorch-lightning#17903)."""
    checkpoint._last_global_step_saved = step


def skip_sigterm_broadcast(trainer: Trainer) -> None:
    """Lightning's SIGTERM handling off for this trainer's fit (before its handler is registered): the broadcast its
    handler makes (a collective only the signalled rank enters) and the per-micro-batch broadcast and host read."""
    trainer._signal_connector._sigterm_notifier_fn = lambda signum, frame: None
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


def nvml_device_index(cuda_index: int) -> int:
    """NVML's number for the GPU CUDA numbers ``cuda_index`` (``CUDA_VISIBLE_DEVICES`` applied), without CUDA."""
    return torch.cuda._get_nvml_device_index(cuda_index)


def process_group_timeout(trainer: Trainer) -> timedelta | None:
    """The timeout of the strategy's process group; None where the strategy has none."""
    return getattr(trainer.strategy, "_timeout", None)


def compiled_in_place(module: torch.nn.Module) -> bool:
    """Whether ``module.compile()`` was called on this module."""
    return getattr(module, "_compiled_call_impl", None) is not None


def inductor_default_cache_dir() -> str | None:
    """inductor's default cache folder (``$TORCHINDUCTOR_CACHE_DIR`` unset), or None if this torch hides it."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # older torch kept it beside the other runtime helpers
        try:
            from torch._inductor.runtime.runtime_utils import default_cache_dir  # type: ignore[no-redef]
        except ImportError:
            return None
    return default_cache_dir()


def inductor_cxx_compiler_missing() -> str | None:
    """Why inductor finds no C++ compiler for CPU kernels (its search of ``$CXX`` and ``g++``), or None,
    also where this torch has moved the search (the compile then goes ahead and reports for itself)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
        from torch._inductor.exc import InvalidCxxCompiler
    except ImportError:
        return None
    try:
        get_cpp_compiler()
    except InvalidCxxCompiler as error:
        return str(error)
    return None


def averaged_model(callback: Any) -> torch.nn.Module | None:
    """A ``WeightAveraging`` callback's ``AveragedModel``; None outside ``fit`` (made in its ``setup``)."""
    return getattr(callback, "_average_model", None)


def swap_averaged_weights(callback: Any, module: torch.nn.Module) -> None:
    """Swap the values of ``module``'s weights and of the callback's averaged ones, as it does for validation."""
    callback._swap_models(module)


def averaging_device(callback: Any) -> torch.device | int | None:
    """The device a ``WeightAveraging`` callback was given for its copy (None: the model's)."""
    return getattr(callback, "_device", None)


def format_summary_table(*args: Any) -> str:
    """Lightning's model-summary table, from the arguments ``ModelSummary.summarize`` is given."""
    from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table

    return _format_summary_table(*args)


def loss_scale(scaler: torch.amp.GradScaler) -> torch.Tensor:
    """The GradScaler's scale as a tensor on the device: no host read."""
    return scaler._get_scale_async()


def unscales_in_step(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` unscales a GradScaler's gradients inside its own step (fused AdamW)."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)


def tensor_versions(tensors: Any) -> tuple[int, ...]:
    """Each tensor's in-place change counter: equal tuples, no tensor written since."""
    return tuple(t._version for t in tensors)


def muon_math() -> tuple[Callable[..., torch.Tensor], Callable[..., float]]:
    """torch's Muon orthogonalization (``_zeropower_via_newtonschulz``) and per-shape rate (``_adjust_lr``).
    Imported when called: torch < 2.9 has no Muon, and ``require_muon`` says so first."""
    from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz, _adjust_lr


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string ``parser`` knows."""
    return [option for action in parser._actions for option in action.option_strings]


def rank_zero_logger() -> logging.Logger:
    """The logger Lightning's ``rank_zero_info`` / ``rank_zero_warn`` write to."""
    import lightning_utilities.core.rank_zero as rank_zero

    return rank_zero.log


def fit_ends_this_epoch(trainer: Trainer) -> bool:
    """``trainer.fit_loop.done``, read without the "`Trainer.fit` stopped" line it logs each time it is read
    (Lightning reads it too, and prints the line then)."""
    with mock.patch.object(rank_zero_logger(), "disabled", True):
        return trainer.fit_loop.done


class CheckpointArguments:
    """Mixin for a ``LightningCLI``: Lightning's ``_parse_ckpt_path`` runs the subclass's public
    ``parse_ckpt_path`` instead, which may call ``lightning_parse_ckpt_path(self)`` for Lightning's."""

    def _parse_ckpt_path(self) -> None:
        self.parse_ckpt_path()


def lightning_parse_ckpt_path(cli: LightningCLI) -> None:
    LightningCLI._parse_ckpt_path(cli)


def add_configure_optimizers(cli: LightningCLI, subcommand: str | None) -> None:
    """What ``LightningCLI.instantiate_classes`` does after building the classes: the
    ``--optimizer`` / ``--lr_scheduler`` given on the command line, if any, become the model's."""
    cli._add_configure_optimizers_method_to_model(subcommand)


@contextmanager
def watch_launched_ranks(on_start: Callable[[list[Any]], None], on_end: Callable[[list[Any]], None]) -> Iterator[None]:
    """Lightning's launcher polls the ranks it started (a thread, every 5 s) and SIGKILLs every process once one
    ended non-zero. Of a launch in the ``with``, ``on_start(procs)`` hears of them, and ``on_end(procs)`` runs
    in place of that SIGKILL. After the ``with``, Lightning's watcher is back."""
    from lightning.fabric.strategies.launchers import subprocess_script

    lightnings = subprocess_script._ChildProcessObserver

    class Watcher(lightnings):  # type: ignore[misc, valid-type]
        def __init__(self, main_pid: int, child_processes: list[Any], sleep_period: int = 5) -> None:
            super().__init__(main_pid=main_pid, child_processes=child_processes, sleep_period=sleep_period)
            on_start(child_processes)

        def _terminate_all(self) -> None:
            on_end(self._child_processes)

    with mock.patch.object(subprocess_script, "_ChildProcessObserver", Watcher):
        yield
