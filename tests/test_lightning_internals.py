"""Every private Lightning (and torch / argparse) name gpt-lightning uses stands in
gpt_lightning/lightning_internals.py, and each is checked against the installed versions: a release
that moves one fails here, naming it, rather than deep inside a fit."""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import logging
import textwrap
from collections.abc import Callable
from datetime import timedelta
from types import SimpleNamespace

import lightning
import pytest
import torch
from conftest import REPO
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import DDPStrategy

from gpt_lightning.lightning_internals import compiled_in_place, inductor_default_cache_dir, muon_math


def _watcher_ends_through_terminate_all() -> bool:
    """Whether the launcher builds its watcher by the module's name, and the watcher, seeing a rank ended
    non-zero, ends the run through ``_terminate_all`` with the ranks in ``_child_processes``."""
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
    "ModelCheckpoint._last_global_step_saved": lambda: (
        _present(ModelCheckpoint(), "_last_global_step_saved")
        and "self._last_global_step_saved == trainer.global_step" in inspect.getsource(ModelCheckpoint)
    ),
    "fit_loop.epoch_loop._broadcast_sigterm_tensor": lambda: _calls_sigterm_broadcast(),
    "trainer._signal_connector._sigterm_notifier_fn": lambda: (
        "self._sigterm_notifier_fn"
        in inspect.getsource(Trainer(logger=False)._signal_connector.register_signal_handlers)
    ),
    "torch.cuda._get_nvml_device_index": lambda: callable(getattr(torch.cuda, "_get_nvml_device_index", None)),
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
    "torch.optim._muon._zeropower_via_newtonschulz and _adjust_lr": lambda: (
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
    """None while ``name`` (a key of ``CHECKS``) is where lightning_internals.py reaches for it, else what to do."""
    if CHECKS[name]():
        return None
    return (
        f"{name} is gone in lightning {lightning.__version__} / torch {torch.__version__}: "
        f"gpt_lightning/lightning_internals.py uses it; update it there."
    )


# Underscored names used elsewhere on purpose, by full name: the compile entry points torch
# documents (torch.compile's docs and the torch.compiler pages), and os._exit (an exit that runs no
# destructors, for a rank whose peer went away). A name is allowed when its dotted path starts with one.
ALLOWED = (
    "torch._dynamo.config",
    "torch._inductor.config",
    "torch._dynamo.mark_static_address",
    "torch._dynamo.mark_dynamic",
    "torch._dynamo.maybe_mark_dynamic",
    "torch._dynamo.mark_static",
    "torch._inductor.list_mode_options",
    "torch._inductor.list_options",
    "os._exit",
)
# Calls whose string argument names an attribute or a module.
BY_STRING = {"getattr", "setattr", "hasattr", "delattr", "attrgetter", "import_module", "__import__"}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_each_private_name_is_where_we_reach_for_it(name):
    assert check(name) is None, check(name)


def test_a_moved_name_fails_with_a_message_that_names_it(monkeypatch):
    monkeypatch.delattr(LightningCLI, "_parse_ckpt_path")
    message = check("LightningCLI._parse_ckpt_path")
    assert "LightningCLI._parse_ckpt_path is gone in lightning" in message
    assert "gpt_lightning/lightning_internals.py" in message


def private(dotted: str) -> bool:
    return any(part.startswith("_") and not part.startswith("__") for part in dotted.split("."))


def allowed(dotted: str) -> bool:
    return any(dotted == name or dotted.startswith(name + ".") for name in ALLOWED)


def attribute_chain(node: ast.Attribute) -> tuple[str, list[str]]:
    """``a.b._c`` as a string, and the attributes in it that are not ours (past ``self._x``)."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.insert(0, node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in ("self", "cls"):
        return ".".join(attrs), attrs[1:]  # self._x is ours; self.x._y is another object's
    base = [node.id] if isinstance(node, ast.Name) else []  # a module-level _NAME of ours is ours
    return ".".join(base + attrs), attrs


def private_names(source: str) -> list[tuple[int, str]]:
    """Every private name ``source`` reaches for: attributes, imports, and names in strings given to
    getattr / setattr / hasattr / delattr / attrgetter / import_module / __import__."""
    tree = ast.parse(source)
    inner = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Attribute) and id(node) not in inner:  # a whole chain, once
            dotted, theirs = attribute_chain(node)
            if private(".".join(theirs)):
                names.append(dotted)
        elif isinstance(node, ast.Import):
            # ``import torch._inductor`` only where an allowed name is inside it
            names += [
                alias.name for alias in node.names if not any(name.startswith(alias.name + ".") for name in ALLOWED)
            ]
        elif isinstance(node, ast.ImportFrom):
            names += [f"{node.module or ''}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if func in BY_STRING:
                names += [
                    arg.value for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                ]
        found += [(node.lineno, name) for name in names if private(name) and not allowed(name)]
    return found


def test_the_guard_sees_names_in_strings_and_allows_only_named_entry_points():
    source = """
import torch._inductor
import torch._inductor.config
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
getattr(module, "_compiled_call_impl", None)
torch._dynamo.mark_static_address(x)
torch._dynamo.reset()
torch._inductor.config.patch(freezing=True)
self._mine.public
_OURS.get(key)
self.loop._theirs
os._exit(1)
"""
    assert sorted(name for _, name in private_names(source)) == [
        "_compiled_call_impl",
        "loop._theirs",
        "torch._dynamo.reset",
        "torch._inductor.runtime.cache_dir_utils.default_cache_dir",
    ]


def test_no_other_module_reaches_for_a_private_name():
    found = []
    for path in (REPO / "gpt_lightning").rglob("*.py"):
        if path.name == "lightning_internals.py":
            continue
        found += [
            f"{path.relative_to(REPO)}:{line} {name}" for line, name in private_names(path.read_text(encoding="utf-8"))
        ]
    assert not found, found


def test_every_private_name_lightning_internals_reaches_for_is_checked():
    source = (REPO / "gpt_lightning" / "lightning_internals.py").read_text(encoding="utf-8")
    checked = " ".join(CHECKS)
    unchecked = [
        name for _, name in private_names(source) if [p for p in name.split(".") if private(p)][-1] not in checked
    ]
    assert not unchecked, f"add a check to CHECKS for {unchecked}"


def test_the_sigterm_broadcast_check_fails_when_lightning_stops_calling_it(monkeypatch):
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    def advance(self, data_fetcher):  # a release that broadcasts somewhere else
        pass

    monkeypatch.setattr(_TrainingEpochLoop, "advance", advance)
    assert "_broadcast_sigterm_tensor is gone" in check("fit_loop.epoch_loop._broadcast_sigterm_tensor")


def test_the_launcher_watcher_check_fails_when_lightning_ends_the_run_another_way(monkeypatch):
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    def run(self):  # a release whose watcher kills the processes itself
        return True

    monkeypatch.setattr(_ChildProcessObserver, "_run", run)
    assert "_ChildProcessObserver._terminate_all is gone" in check(
        "launchers.subprocess_script._ChildProcessObserver._terminate_all"
    )
