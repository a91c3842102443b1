"""Every private Lightning (and torch / argparse) name gpt-lightning uses stands in
gpt_lightning/lightning_internals.py, and each is checked against the installed versions: a release
that moves one fails here, naming it, rather than deep inside a fit."""

from __future__ import annotations

import ast

import pytest
from lightning.pytorch.cli import LightningCLI

from gpt_lightning import lightning_internals
from gpt_lightning.lightning_internals import CHECKS, check

from conftest import REPO

# Underscored names used elsewhere on purpose: torch's documented compile helpers, and Python's
# os._exit (public and documented: an exit that runs no destructors, for a rank whose peer went away).
ALLOWED = {"_dynamo", "_inductor", "_exit"}


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


def test_no_other_module_reaches_for_a_private_name():
    found = []
    for path in (REPO / "gpt_lightning").rglob("*.py"):
        if path.name == "lightning_internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = node.attr if isinstance(node, ast.Attribute) else None
            if isinstance(node, ast.ImportFrom):
                name = next((alias.name for alias in node.names if alias.name.startswith("_")), None)
                name = name or next((part for part in (node.module or "").split(".") if part.startswith("_")), None)
            if not name or not name.startswith("_") or name.startswith("__") or name in ALLOWED:
                continue
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue  # our own objects' attributes
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
    assert not found, found
