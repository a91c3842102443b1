"""Every private Lightning (and torch / argparse) name gpt-lightning uses stands in
gpt_lightning/lightning_internals.py, and each is checked against the installed versions: a release
that moves one fails here, naming it, rather than deep inside a fit."""

from __future__ import annotations

import ast

import pytest
from conftest import REPO
from lightning.pytorch.cli import LightningCLI

from gpt_lightning import lightning_internals
from gpt_lightning.lightning_internals import CHECKS, check

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


def test_the_docstring_lists_every_name_checked():
    for name in CHECKS:
        assert name.split(".")[-1] in lightning_internals.__doc__, name


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
