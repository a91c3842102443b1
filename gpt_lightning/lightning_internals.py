"""The one place gpt-lightning reaches past Lightning's public API (and the few private torch and
argparse names that go with it). Each name below has no public equivalent for what we need;
``tests/test_lightning_internals.py`` checks every one against the installed versions and fails with
``check()``'s message, naming what moved, instead of an ``AttributeError`` deep in a fit. They are
why ``pyproject.toml`` pins ``lightning<2.7``: a new release is adopted by running that test first.

Lightning:

- ``trainer.fit_loop.epoch_loop._batches_that_stepped`` (read and written): the step loggers log at.
  Lightning restores it from a checkpoint and may add one on restart; resume sets it back to
  ``global_step`` (``training/resume.py``). Public ``Trainer`` properties only read ``global_step``.
- ``trainer.fit_loop.epoch_loop.batch_progress.current.ready``: the batches of the current epoch
  already run when a pass starts, more than 0 when Lightning resumes mid-epoch, where the data must
  resume too (``data/datamodule.py``). No hook or ``Trainer`` property says it.
- ``lightning.pytorch.utilities.model_summary.model_summary._format_summary_table``: the model
  summary's table, which ``ModelSummary.summarize`` (the public hook we override) formats with it;
  we add a FLOPs line to the same table (``observing/console.py``).
- ``LightningCLI._parse_ckpt_path``: merges a checkpoint's saved hyper-parameters into the parsed
  config (over the user's arguments). No extension point runs in its place: ``CheckpointArguments``
  routes it to ``GPTLightningCLI.parse_ckpt_path`` (``lightning_cli.py``).
- ``LightningCLI._add_configure_optimizers_method_to_model``: what ``instantiate_classes`` does
  after building the classes, which our meta-device ``instantiate_classes`` must do as well.
- ``trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor``: under DDP Lightning broadcasts a SIGTERM
  flag and reads it on the host before every micro-batch (a collective and a sync each). No setting
  turns it off; ``training/preemption.py`` replaces it on the loop instance with a no-op, as it
  agrees on stopping itself, once per optimizer step.
- ``trainer.strategy._timeout``: the timeout a DDP / FSDP / model-parallel strategy gave its process
  group; ``Preemption``'s side group waits as long (no public property says it).
- ``lightning_utilities.core.rank_zero.log``: the logger rank-zero messages go through, which the CLI
  filters (``quiet_lightning_console``); a module-level name, not exported.

torch and argparse:

- ``GradScaler._get_scale_async``: the loss scale as a tensor; ``get_scale()`` reads it back to the
  host (a sync per step) (``training/nonfinite.py``).
- ``Optimizer._step_supports_amp_scaling``: whether an optimizer (fused AdamW) unscales inside its
  own step, where Lightning leaves the gradients scaled (``training/nonfinite.py``).
- ``argparse.ArgumentParser._actions``: every option a parser knows, for "did you mean"
  (``lightning_cli.py``).
- ``Tensor._version``: the counter every in-place change of a tensor bumps (what autograd checks
  saved tensors with). A CPU decode step compiled with inductor's freezing holds the weights as
  constants; ``generation.py`` compiles it again once a weight has changed since.
- ``torch.optim._muon._zeropower_via_newtonschulz`` and ``_adjust_lr``: torch's Muon math, which
  ``MuonWithAdamW``'s guarded step runs one matrix at a time, gated on the device, instead of
  ``Muon.step()`` (which has no ``found_inf``) on a copy of the weights (``training/optimizers.py``).
"""

from __future__ import annotations

import argparse
import logging
from datetime import timedelta
from typing import Any, Callable

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


def skip_sigterm_broadcast(trainer: Trainer) -> None:
    """Lightning's per-micro-batch SIGTERM broadcast and host read, off for this trainer's fit."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


def process_group_timeout(trainer: Trainer) -> timedelta | None:
    """The timeout of the strategy's process group; None where the strategy has none."""
    return getattr(trainer.strategy, "_timeout", None)


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


def _bumps_version() -> bool:
    tensor = torch.zeros(1)
    before = getattr(tensor, "_version", None)
    tensor.add_(1)
    return isinstance(before, int) and tensor._version > before


def _present(obj: object, name: str) -> bool:
    return hasattr(obj, name)


# name -> (a check that returns True while the installed version still has it)
CHECKS: dict[str, Callable[[], bool]] = {
    "fit_loop.epoch_loop._batches_that_stepped": lambda: _present(Trainer(logger=False).fit_loop.epoch_loop, "_batches_that_stepped"),
    "fit_loop.epoch_loop.batch_progress.current.ready": lambda: _present(
        getattr(getattr(Trainer(logger=False).fit_loop.epoch_loop, "batch_progress", None), "current", None), "ready"),
    "fit_loop.epoch_loop._broadcast_sigterm_tensor": lambda: callable(
        getattr(Trainer(logger=False).fit_loop.epoch_loop, "_broadcast_sigterm_tensor", None)),
    "strategy._timeout": lambda: getattr(DDPStrategy(timeout=timedelta(seconds=7)), "_timeout", None) == timedelta(seconds=7),
    "model_summary._format_summary_table": lambda: _present(
        __import__("lightning.pytorch.utilities.model_summary.model_summary", fromlist=["_"]), "_format_summary_table"),
    "LightningCLI._parse_ckpt_path": lambda: _present(LightningCLI, "_parse_ckpt_path"),
    "LightningCLI._add_configure_optimizers_method_to_model": lambda: _present(LightningCLI, "_add_configure_optimizers_method_to_model"),
    "lightning_utilities.core.rank_zero.log": lambda: isinstance(getattr(
        __import__("lightning_utilities.core.rank_zero", fromlist=["_"]), "log", None), logging.Logger),
    "GradScaler._get_scale_async": lambda: _present(torch.amp.GradScaler, "_get_scale_async"),
    "Optimizer._step_supports_amp_scaling": lambda: getattr(torch.optim.AdamW([torch.zeros(1, requires_grad=True)], fused=True),
                                                            "_step_supports_amp_scaling", None) is True,
    "ArgumentParser._actions": lambda: isinstance(getattr(argparse.ArgumentParser(), "_actions", None), list),
    "Tensor._version": lambda: _bumps_version(),
    "torch.optim._muon._zeropower_via_newtonschulz": lambda: not hasattr(torch.optim, "Muon") or all(
        callable(f) for f in muon_math()),
}


def check(name: str) -> str | None:
    """None while ``name`` (a key of ``CHECKS``) is where this module reaches for it, else what to do."""
    if CHECKS[name]():
        return None
    import lightning

    return (f"{name} is gone in lightning {lightning.__version__} / torch {torch.__version__}: "
            f"gpt_lightning/lightning_internals.py uses it (see its docstring for why); update it there.")
