"""The package's layout: rooms that import only downwards, no cycles, the public names importable,
no private torch op called, and nothing that changes a warning or log filter when imported."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY_MODEL
from lightning.pytorch import LightningModule

PACKAGE = REPO / "gpt_lightning"
# Lowest first. A module may import from its own room and from lower layers only: rooms of one layer
# do not know each other (training and observing are independent; interop and scaling too).
LAYERS = (
    {"errors"},  # UserError: what every layer raises for a user's mistake
    # host_memory: glibc's malloc kept from unmapping freed blocks; lightning_internals: the one room
    # that reaches into Lightning's private names; config: the GPT's architecture; precision: what a
    # Lightning precision means (dtypes, a GradScaler)
    {"atomic", "host_memory", "lightning_internals", "config", "precision"},
    {"model", "data", "loss"},  # loss: the training loss in chunks, plain torch as the model
    {"stopping"},  # how a run stops: a signal, a rank gone, the process-group timeout scaling's strategy takes
    {"scaling", "interop", "generation", "averaging"},  # generation: sampling from a GPT; averaging: the weight EMA
    {"training", "observing", "evaluation"},  # evaluation: lm-evaluation-harness on a GPT (the optional eval extra)
    {"lightning_cli"},  # GPTLightningCLI: the module, the data and the callbacks put together
    {"cli", "commands"},  # the gpt-lightning command and its own subcommands
    {"__main__"},
)
LAYER = {room: level for level, rooms in enumerate(LAYERS) for room in rooms}


def module_name(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path) -> set[str]:
    """Every ``gpt_lightning`` module ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("gpt_lightning")}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("gpt_lightning"):
            found.add(node.module)
            if node.module == "gpt_lightning":  # from gpt_lightning import _moved
                found |= {f"gpt_lightning.{alias.name}" for alias in node.names}
    return found


def room(module: str) -> str:
    return module.split(".")[1]


GRAPH = {
    module_name(path): imports_of(path)
    for path in PACKAGE.rglob("*.py")
    if path.name != "__init__.py" or path.parent != PACKAGE
}


def test_every_room_has_a_layer():
    assert {room(module) for module in GRAPH} == set(LAYER)


def test_imports_run_downwards_only():
    upward = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        for target in targets
        if target != "gpt_lightning" and room(target) != room(module) and LAYER[room(target)] >= LAYER[room(module)]
    ]
    assert not upward, "\n".join(upward)
    # the two ends of the house: the pure model and the data never import anything that trains or watches
    for module, targets in GRAPH.items():
        if room(module) in ("model", "data"):
            assert {room(t) for t in targets} <= {
                "model",
                "data",
                "errors",
                "atomic",
                "lightning_internals",
                "config",
                "precision",
            }, module


def test_no_import_cycles():
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module) :] + [module]))
        if module in done or module not in GRAPH:
            return
        path.append(module)
        for target in GRAPH[module]:
            visit(target)
        path.pop()
        done.add(module)

    for module in GRAPH:
        visit(module)


def test_the_public_names_are_the_modules_own_and_no_import_hook_is_installed():
    import gpt_lightning
    from gpt_lightning.observing.throughput import ThroughputMonitor
    from gpt_lightning.training.module import GPTLightningModule

    assert (
        GPTLightningModule is gpt_lightning.GPTLightningModule and ThroughputMonitor is gpt_lightning.ThroughputMonitor
    )
    for name in gpt_lightning.__all__:
        assert getattr(gpt_lightning, name) is not None
    assert not [finder for finder in sys.meta_path if type(finder).__module__.startswith("gpt_lightning")]
    with pytest.raises(ModuleNotFoundError):  # the pre-0.1 top-level paths are gone (CHANGELOG)
        importlib.import_module("gpt_lightning.module")


def test_no_private_torch_op_is_called():
    """Private ops (``torch.ops.mkldnn._linear_pointwise``, ...) change with any torch release and have
    no DTensor rule: the package calls torch's public API only."""
    called = [
        f"{path.relative_to(REPO)}:{n}"
        for path in PACKAGE.rglob("*.py")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "torch.ops." in line
    ]
    assert not called, called


def test_a_checkpoint_naming_the_class_path_loads(tmp_path):
    """A run of a stock ``LightningCLI`` records ``_class_path`` in its checkpoint's hyper-parameters;
    Lightning imports it (through jsonargparse) to rebuild the module."""
    from gpt_lightning.training.module import GPTLightningModule

    module = GPTLightningModule(**TINY_MODEL, block_size=16)
    hyper_parameters = {
        **module.hparams,
        "_class_path": "gpt_lightning.training.module.GPTLightningModule",
        "_instantiator": "lightning.pytorch.cli.instantiate_module",
    }
    path = tmp_path / "old.ckpt"
    torch.save(
        {"state_dict": module.state_dict(), "hyper_parameters": hyper_parameters, "pytorch-lightning_version": "2.6.0"},
        path,
    )
    loaded = LightningModule.load_from_checkpoint(path, map_location="cpu", weights_only=False)
    assert type(loaded) is GPTLightningModule
    assert torch.equal(loaded.model.transformer.wte.weight, module.model.transformer.wte.weight)


IMPORT_EVERYTHING = """
import logging, sys, warnings
import torch, lightning.pytorch, lightning_utilities.core.rank_zero, requests  # their own import-time settings first (requests: lm_eval's)

def state():
    loggers = {name: (list(logger.filters), list(logger.handlers), logger.level)
               for name, logger in logging.root.manager.loggerDict.items() if isinstance(logger, logging.Logger)}
    return list(warnings.filters), loggers, list(logging.root.filters), list(logging.root.handlers)

before = state()
import importlib
for name in sys.argv[1:]:
    importlib.import_module(name)
after = state()
assert before[0] == after[0], [f for f in after[0] if f not in before[0]]
assert before[2:] == after[2:]
changed = [name for name, value in before[1].items() if after[1][name] != value]
assert not changed, changed
print("unchanged", len(sys.argv) - 1)
"""


def test_importing_changes_no_warning_or_log_filter():
    """A project that imports the module, the data module or any other part sees its own warnings:
    filters are set by the CLI (``quiet_lightning_console``), never on import."""
    modules = sorted(name for name in GRAPH if not name.endswith("__main__"))
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_EVERYTHING, *modules], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"unchanged {len(modules)}" in result.stdout


DOC_SECTIONS = ("Args:", "Returns:", "Raises:", "Yields:", "Attributes:")


def prose_lines(docstring: str) -> int:
    """Non-blank lines of a docstring outside its Args: / Returns: / ... blocks."""
    count, section_indent = 0, None
    for line in docstring.expandtabs().splitlines():
        indent = len(line) - len(line.lstrip())
        if line.strip() in DOC_SECTIONS:
            section_indent = indent
        elif section_indent is not None and (not line.strip() or indent > section_indent):
            continue  # inside the block
        else:
            section_indent = None
            count += bool(line.strip())
    return count


def essays(source: str) -> list[tuple[int, str, int, int]]:
    """(line, name, docstring prose lines, body lines) of each function or class whose docstring has 6+
    lines and, beyond its Args: / Returns: block, more lines than the code it documents."""
    tree, lines = ast.parse(source), source.splitlines()
    found = []
    for node in ast.walk(tree):
        docstring = (
            ast.get_docstring(node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else None
        )
        if docstring is None:
            continue
        doc = node.body[0]
        body = {i for stmt in node.body[1:] for i in range(stmt.lineno, stmt.end_lineno + 1)}
        for inner in ast.walk(node):  # nested docstrings are not code
            if (
                inner is not node
                and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and ast.get_docstring(inner) is not None
            ):
                body -= set(range(inner.body[0].lineno, inner.body[0].end_lineno + 1))
        code = sum(1 for i in body if lines[i - 1].strip() and not lines[i - 1].strip().startswith("#"))
        prose = prose_lines(docstring)
        if doc.end_lineno - doc.lineno + 1 >= 6 and prose > code:
            found.append((node.lineno, node.name, prose, code))
    return found


def test_the_guard_finds_an_essay_and_spares_an_args_block():
    essay = 'def f(x):\n    """One.\n\n    Two.\n    Three.\n    Four.\n    """\n    return x\n'
    args = 'def f(x):\n    """One.\n\n    Args:\n        x: a.\n        y: b.\n    """\n    return x\n'
    assert essays(essay) == [(1, "f", 4, 1)] and essays(args) == []


def test_no_docstring_is_an_essay():
    """A docstring says what and why in a few lines: a 6+ line docstring is never longer than its
    code beyond its Args: block (the story of a change goes in its commit message, a user's guide in docs/)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(REPO).as_posix()
        found += [
            f"{relative}:{line} {name}: {prose} lines of docstring over {code} of code"
            for line, name, prose, code in essays(path.read_text(encoding="utf-8"))
        ]
    assert not found, found
