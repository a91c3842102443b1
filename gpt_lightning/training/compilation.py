"""How the GPT is compiled (in place, whole or by regions), when, and saying so; why: docs/first-step.md."""

from __future__ import annotations

import contextlib
import os
import sys
import sysconfig
import tempfile
import types
from contextlib import AbstractContextManager
from pathlib import Path

import torch
import torch._inductor

from gpt_lightning.errors import UserError
from gpt_lightning.lightning_internals import (
    compiled_in_place,
    inductor_cxx_compiler_missing,
    inductor_default_cache_dir,
)
from gpt_lightning.model import GPT


def compile_in_place(model: GPT, scope: str, **options: object) -> None:
    """``torch.compile`` the GPT in place, so ``state_dict`` keys stay plain: whole (``scope`` "model")
    or each ``Block`` (one graph reused by every block) plus the head and loss (``scope`` "blocks")."""
    if scope == "model":
        model.compile(**options)
        return
    for block in model.transformer.h:
        block.compile(**options)
    # A bound method: parameter names stay, and a deepcopy (an EMA copy) binds it to the copy's weights.
    model.head_and_loss = types.MethodType(torch.compile(type(model).head_and_loss, **options), model)


def check_kernels_can_build(device_type: str | None) -> None:
    """Raise ``UserError`` where ``torch.compile`` cannot build its kernels, before it tries: they are
    Python extensions (Python's headers) and, on ``device_type`` "cpu", C++ (a compiler). None: headers only."""
    eager = "or run eager: --model.compile false (fit), without --compile (sample)."
    # Inductor passes both of these to the compiler (a Debian Python's default scheme has its own include)
    folders = {sysconfig.get_path("include"), sysconfig.get_config_var("INCLUDEPY")}
    if os.name == "posix":
        folders.add(sysconfig.get_path("include", scheme="posix_prefix"))
    found = any(folder and (Path(folder) / "Python.h").is_file() for folder in folders)
    if sys.platform != "darwin" and not found:  # (macOS: inductor also looks in Python's framework)
        raise UserError(
            "torch.compile builds its kernels against Python's headers, and this Python has none (no Python.h "
            f"in {', '.join(sorted(f for f in folders if f))}). Install them (Debian/Ubuntu: apt install "
            f"python3-dev, or pythonX.Y-dev for your version; python.org, pyenv, uv and conda Pythons ship them), {eager}"
        )
    missing = inductor_cxx_compiler_missing() if device_type == "cpu" else None
    if missing:
        raise UserError(
            f"torch.compile builds its CPU kernels with a C++ compiler and found none ({missing}). Install one "
            "(Debian/Ubuntu: apt install g++; macOS: xcode-select --install; Windows: Visual Studio's C++ build "
            f"tools) or name it in $CXX, {eager}"
        )


def check_cuda_graphs_accumulation(compile: bool, mode: str | None, accumulate: int, device: torch.device) -> None:
    """Refuse CUDA graphs under gradient accumulation on CUDA: a replay overwrites the gradient
    accumulated so far (docs/gpu-fast-path.md)."""
    if (
        compile
        and accumulate > 1
        and device.type == "cuda"
        and mode
        and torch._inductor.list_mode_options(mode).get("triton.cudagraphs")
    ):
        raise UserError(
            f"model.compile_mode {mode!r} records CUDA graphs, which accumulate {accumulate} micro-batches' "
            "gradients wrongly: use compile_mode null (default) or 'max-autotune-no-cudagraphs', or one "
            "micro-batch per step."
        )


def is_compiled(model: GPT) -> bool:
    """Whether the GPT (or, compiled by regions, its blocks) runs through ``torch.compile``."""
    return any(compiled_in_place(module) for module in (model, model.transformer.h[0]))


def evaluation_stance(compile_eval: bool, sanity_checking: bool) -> AbstractContextManager:
    """``force_eager`` for evaluation unless ``compile_eval`` and not in Lightning's sanity check."""
    if compile_eval and not sanity_checking:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def inductor_cache_dir() -> str:
    """Where inductor caches compiled code: ``$TORCHINDUCTOR_CACHE_DIR``, else its default. Creates nothing."""
    configured = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or inductor_default_cache_dir()
    return os.path.abspath(configured or tempfile.gettempdir())  # a torch that hides its default: somewhere here


def compile_notice(scope: str, compile_eval: bool) -> str:
    """The line printed when a compiled fit starts: what the first step's wait is and where it is cached."""
    what = "the model" if scope == "model" else "each transformer block and the head"
    evaluation = (
        "validation compiles its own graph at the first validation"
        if compile_eval
        else "validation runs eager (--model.compile_eval true compiles it too)"
    )
    return (
        f"torch.compile: compiling {what} in the first training step, which takes longer; cached "
        f"afterwards in {inductor_cache_dir()}, so later runs start faster. {evaluation[0].upper()}{evaluation[1:]}."
    )
