"""The one place gpt-lightning reaches past Lightning's public API (and the private torch and argparse
names that go with it); none has a public equivalent. ``tests/test_lightning_internals.py`` checks each
against the installed versions (``check()`` names what moved), hence ``lightning<2.7`` in pyproject.toml.

Names (user): ``epoch_loop._batches_that_stepped`` (resume), ``batch_progress.current.ready`` (mid-epoch
resume), the other ``batch_progress`` counts (a resume on another layout), ``_format_summary_table``
(FLOPs line in the summary), ``LightningCLI._parse_ckpt_path`` and
``_add_configure_optimizers_method_to_model`` (lightning_cli.py), ``epoch_loop._broadcast_sigterm_tensor``
and ``strategy._timeout`` (preemption), ``lightning_utilities.core.rank_zero.log`` (CLI log filter, ``fit_loop.done`` read quietly),
``GradScaler._get_scale_async`` (nonfinite), ``Optimizer._step_supports_amp_scaling`` (fused AdamW),
``ArgumentParser._actions`` ("did you mean"), ``Tensor._version`` (generation.py), ``_ChildProcessObserver`` (the launcher's watcher of the ranks it
started: its ``_terminate_all`` and ``_child_processes``, launched_ranks.py), torch Muon's
``_zeropower_via_newtonschulz`` and ``_adjust_lr`` (optimizers.py), ``nn.Module._compiled_call_impl`` and
inductor's ``default_cache_dir`` and ``get_cpp_compiler`` (compilation.py), ``WeightAveraging._average_model``, ``_swap_models`` and
``_device`` (the averaged model, swapped in for our samples and evaluations, and where it lives:
averaging.py).
"""

from __future__ import annotations

import argparse
import importlib
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import DDPStrategy


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


def skip_sigterm_broadcast(trainer: Trainer) -> None:
    """Lightning's SIGTERM handling off for this trainer's fit (before its handler is registered): the broadcast its
    handler makes (a collective only the signalled rank enters) and the per-micro-batch broadcast and host read."""
    trainer._signal_connector._sigterm_notifier_fn = lambda signum, frame: None
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


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
    logger = rank_zero_logger()
    disabled, logger.disabled = logger.disabled, True
    try:
        return trainer.fit_loop.done
    finally:
        logger.disabled = disabled


class CheckpointArguments:
    """Mixin for a ``LightningCLI``: Lightning's ``_parse_ckpt_path`` runs the subclass's public
    ``parse_ckpt_path`` instead, which may call ``lightning_parse_ckpt_path(self)`` for Lightning's."""

    def _parse_ckpt_path(self) -> None:
        self.parse_ckpt_path()

    def parse_ckpt_path(self) -> None:
        lightning_parse_ckpt_path(self)


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

    subprocess_script._ChildProcessObserver = Watcher
    try:
        yield
    finally:
        subprocess_script._ChildProcessObserver = lightnings


def _watcher_ends_through_terminate_all() -> bool:
    """Whether the launcher builds its watcher by the module's name, and the watcher, seeing a rank ended
    non-zero, ends the run through ``_terminate_all`` with the ranks in ``_child_processes``."""
    import inspect
    from types import SimpleNamespace

    from lightning.fabric.strategies.launchers import subprocess_script

    observer = subprocess_script._ChildProcessObserver
    ended, seen = SimpleNamespace(poll=lambda: None, returncode=-9, pid=0), []

    class Probe(observer):  # type: ignore[misc, valid-type]
        def _terminate_all(self) -> None:
            seen.append(list(self._child_processes))

    Probe(main_pid=0, child_processes=[ended])._run()
    return seen == [[ended]] and "_ChildProcessObserver(" in inspect.getsource(
        subprocess_script._launch_process_observer
    )


def _bumps_version() -> bool:
    tensor = torch.zeros(1)
    before = getattr(tensor, "_version", None)
    tensor.add_(1)
    return isinstance(before, int) and tensor._version > before


def _present(obj: object, name: str) -> bool:
    return hasattr(obj, name)


def _calls_sigterm_broadcast() -> bool:
    """Whether the training epoch loop's ``advance`` still calls ``self._broadcast_sigterm_tensor()``,
    and that method still broadcasts: replacing it with a no-op then turns the broadcast off."""
    import ast
    import inspect
    import textwrap

    loop = type(Trainer(logger=False).fit_loop.epoch_loop)
    method = getattr(loop, "_broadcast_sigterm_tensor", None)
    try:
        if not callable(method) or "broadcast(" not in inspect.getsource(method):
            return False
        tree = ast.parse(textwrap.dedent(inspect.getsource(loop.advance)))
    except (OSError, TypeError):  # no source to read: unknown, so not vouched for
        return False
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "_broadcast_sigterm_tensor"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
        for node in ast.walk(tree)
    )


def _weight_averaging_has(name: str) -> bool:
    from lightning.pytorch.callbacks import EMAWeightAveraging

    callback = EMAWeightAveraging(device="cpu")
    if name == "_swap_models":
        return callable(getattr(callback, name, None))
    return name in vars(callback)


def _compile_sets_compiled_call_impl() -> bool:
    module = torch.nn.Linear(1, 1)
    before = compiled_in_place(module)
    module.compile()  # lazy: nothing compiles until a call
    return not before and compiled_in_place(module)


# name -> (a check that returns True while the installed version still has it)
CHECKS: dict[str, Callable[[], bool]] = {
    "fit_loop.epoch_loop._batches_that_stepped": lambda: _present(
        Trainer(logger=False).fit_loop.epoch_loop, "_batches_that_stepped"
    ),
    "fit_loop.epoch_loop.batch_progress.current.ready": lambda: _present(
        getattr(getattr(Trainer(logger=False).fit_loop.epoch_loop, "batch_progress", None), "current", None), "ready"
    ),
    "fit_loop.epoch_loop.batch_progress": lambda: (
        all(
            _present(getattr(Trainer(logger=False).fit_loop.epoch_loop.batch_progress, part), name)
            for part in ("current", "total")
            for name in ("ready", "started", "processed", "completed")
        )
        and _present(Trainer(logger=False).fit_loop.epoch_loop.batch_progress, "is_last_batch")
    ),
    "fit_loop.epoch_loop._broadcast_sigterm_tensor": lambda: _calls_sigterm_broadcast(),
    "strategy._timeout": lambda: (
        getattr(DDPStrategy(timeout=timedelta(seconds=7)), "_timeout", None) == timedelta(seconds=7)
    ),
    "model_summary._format_summary_table": lambda: _present(
        __import__("lightning.pytorch.utilities.model_summary.model_summary", fromlist=["_"]), "_format_summary_table"
    ),
    "LightningCLI._parse_ckpt_path": lambda: _present(LightningCLI, "_parse_ckpt_path"),
    "LightningCLI._add_configure_optimizers_method_to_model": lambda: _present(
        LightningCLI, "_add_configure_optimizers_method_to_model"
    ),
    "lightning_utilities.core.rank_zero.log": lambda: isinstance(
        getattr(__import__("lightning_utilities.core.rank_zero", fromlist=["_"]), "log", None), logging.Logger
    ),
    "GradScaler._get_scale_async": lambda: _present(torch.amp.GradScaler, "_get_scale_async"),
    "Optimizer._step_supports_amp_scaling": lambda: (
        getattr(torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True), "_step_supports_amp_scaling", None)
        is True
    ),
    "ArgumentParser._actions": lambda: isinstance(getattr(argparse.ArgumentParser(), "_actions", None), list),
    "Tensor._version": lambda: _bumps_version(),
    "launchers.subprocess_script._ChildProcessObserver._terminate_all": lambda: _watcher_ends_through_terminate_all(),
    "torch.optim._muon._zeropower_via_newtonschulz": lambda: (
        not hasattr(torch.optim, "Muon") or all(callable(f) for f in muon_math())
    ),
    "nn.Module._compiled_call_impl": lambda: _compile_sets_compiled_call_impl(),
    "WeightAveraging._average_model": lambda: _weight_averaging_has("_average_model"),
    "WeightAveraging._swap_models": lambda: _weight_averaging_has("_swap_models"),
    "WeightAveraging._device": lambda: _weight_averaging_has("_device"),
    "torch._inductor.runtime.cache_dir_utils.default_cache_dir": lambda: isinstance(inductor_default_cache_dir(), str),
    "torch._inductor.cpp_builder.get_cpp_compiler": lambda: (
        callable(getattr(importlib.import_module("torch._inductor.cpp_builder"), "get_cpp_compiler", None))
        and _present(importlib.import_module("torch._inductor.exc"), "InvalidCxxCompiler")
    ),
}


def check(name: str) -> str | None:
    """None while ``name`` (a key of ``CHECKS``) is where this module reaches for it, else what to do."""
    if CHECKS[name]():
        return None
    import lightning

    return (
        f"{name} is gone in lightning {lightning.__version__} / torch {torch.__version__}: "
        f"gpt_lightning/lightning_internals.py uses it (see its docstring for why); update it there."
    )
