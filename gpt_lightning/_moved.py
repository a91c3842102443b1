"""Old import paths of modules that moved into subpackages, kept working.

Class paths written before the move (``gpt_lightning.module.GPTLightningModule`` in a config file,
or in the ``hparams.yaml`` / ``config.yaml`` of an old run) and imports in users' code resolve to the
very module at its new place: the same module object, so the same classes, not a copy.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
from types import CodeType, ModuleType

MOVED = {
    "gpt_lightning.module": "gpt_lightning.training.module",
    "gpt_lightning.nonfinite": "gpt_lightning.training.nonfinite",
    "gpt_lightning.compilation": "gpt_lightning.training.compilation",
    "gpt_lightning.throughput": "gpt_lightning.observing.throughput",
    "gpt_lightning.console": "gpt_lightning.observing.console",
    "gpt_lightning.checkpoint": "gpt_lightning.interop.checkpoint",
    "gpt_lightning.weights": "gpt_lightning.interop.weights",
    "gpt_lightning.pretrained": "gpt_lightning.interop.pretrained",
    "gpt_lightning.hellaswag": "gpt_lightning.interop.hellaswag",
    "gpt_lightning.sharding": "gpt_lightning.scaling.sharding",
    "gpt_lightning.memory": "gpt_lightning.scaling.memory",
}


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the names in ``MOVED`` (and nothing else) and answers each with its new module."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # already executed at its new place

    def get_code(self, fullname: str) -> CodeType | None:
        """For ``python -m gpt_lightning.memory``: the new module's code."""
        new = importlib.util.find_spec(MOVED[fullname])
        return new.loader.get_code(new.name)


def install() -> None:
    """Put the finder on ``sys.meta_path`` once; it only ever answers for ``gpt_lightning.*`` names above."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
