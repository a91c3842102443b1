"""How the GPT is compiled (in place, whole or by regions), when ``torch.compile`` compiles, and
saying so: training compiles once, evaluation runs eager.

A compiled model compiles one graph per mode it runs in: training (with gradients) and evaluation
(without them, in ``eval()`` mode). Evaluation is a few batches: the two of Lightning's sanity check
before the first step, then ``limit_val_batches`` every ``val_check_interval`` steps. Compiling a
second graph for them would be spent in the sanity check, before the first training step and with
no word on screen, to speed up batches that take a fraction of a second eager. So evaluation runs
eager (the same module code and weights, without Dynamo) unless ``GPTLightningModule(compile_eval=True)``
asks for its graph; even then the sanity check stays eager and the evaluation graph compiles at the
first real validation, after training has started.
``benchmarks/first_step.py`` measures both over a whole run.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import tempfile
import types
from typing import ContextManager

import torch
import torch._inductor

from gpt_lightning.errors import UserError
from gpt_lightning.model import GPT


def compile_in_place(model: GPT, scope: str, **options: object) -> None:
    """``torch.compile`` the GPT in place, so ``state_dict`` keys stay plain (no ``_orig_mod.``).

    Args:
        model: the GPT (sharded or not).
        scope: "model": one graph for the whole GPT. "blocks": each transformer ``Block`` (one
            graph, reused by every block) plus the final LayerNorm, LM head and loss as one more
            region; the embeddings stay eager. The repeated block compiles once, not n_layer times.
        options: ``torch.compile``'s ``mode``, ``dynamic``, ``fullgraph``.
    """
    if scope == "model":
        model.compile(**options)
        return
    for block in model.transformer.h:
        block.compile(**options)  # in place, like the whole model: same code, one graph for all
    # A method, not a module: compiling it leaves every parameter name as it is. The compiled
    # function is bound as a method, so a deepcopy (an EMA copy) binds it to the copy's weights, and
    # the module pickles (the unpickled model runs this part eager, as the class defines it).
    model.head_and_loss = types.MethodType(torch.compile(type(model).head_and_loss, **options), model)


def records_cuda_graphs(mode: str | None) -> bool:
    """Whether ``torch.compile(mode=mode)`` records CUDA graphs on a CUDA device ("reduce-overhead",
    "max-autotune"), as torch's own table of mode options says."""
    return bool(mode) and bool(torch._inductor.list_mode_options(mode).get("triton.cudagraphs"))


def check_cuda_graphs_accumulation(compile: bool, mode: str | None, accumulate: int, device: torch.device) -> None:
    """Refuse CUDA graphs (cudagraph trees) under gradient accumulation on a CUDA device.

    The first micro-batch's gradient is a graph output that autograd installs as ``.grad`` without
    a copy; the next replay writes over it, so the accumulated gradient is wrong or torch raises
    "accessing tensor output of CUDAGraphs that has been overwritten" (pytorch#169545, open, even
    with ``cudagraph_mark_step_begin`` and cloned outputs; pytorch#184003 only words the error). On a
    CPU these modes record no graph and train as the default mode.

    Args:
        compile: whether the model is compiled.
        mode: its ``torch.compile`` mode.
        accumulate: micro-batches per optimizer step (``trainer.accumulate_grad_batches``).
        device: the device the model trains on.
    """
    if compile and accumulate > 1 and device.type == "cuda" and records_cuda_graphs(mode):
        raise UserError(
            f"model.compile_mode {mode!r} records CUDA graphs, which accumulate {accumulate} micro-batches' "
            "gradients wrongly: use compile_mode null (default) or 'max-autotune-no-cudagraphs', or one "
            "micro-batch per step."
        )


def is_compiled(model: GPT) -> bool:
    """Whether the GPT (or, compiled by regions, its blocks) runs through ``torch.compile``."""
    return any(getattr(module, "_compiled_call_impl", None) is not None for module in (model, model.transformer.h[0]))


def evaluation_stance(compile_eval: bool, sanity_checking: bool) -> ContextManager:
    """The context to run an evaluation batch (or a validation sample) in.

    Args:
        compile_eval: whether evaluation may run through the compiled model.
        sanity_checking: whether this is Lightning's sanity check, which is always eager: its few
            batches would otherwise compile the evaluation graph before the first training step.

    Returns:
        ``torch.compiler.set_stance("force_eager")`` (every ``torch.compile``'d module and function
        runs its original code, and nothing is compiled), or a no-op context when the compiled model
        may run.
    """
    if compile_eval and not sanity_checking:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def inductor_cache_dir() -> str:
    """The directory where inductor caches compiled code: ``$TORCHINDUCTOR_CACHE_DIR``, else its
    default (``/tmp/torchinductor_<user>``). Creates nothing."""
    configured = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if configured:
        return os.path.abspath(configured)
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # older torch kept it beside the other runtime helpers
        try:
            from torch._inductor.runtime.runtime_utils import default_cache_dir  # type: ignore[no-redef]
        except ImportError:
            default_cache_dir = None  # type: ignore[assignment]
    if default_cache_dir is not None:
        return os.path.abspath(default_cache_dir())
    user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
    return os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")


def compile_notice(scope: str, compile_eval: bool) -> str:
    """The line printed once when a fit starts with a compiled model: what the wait is and where
    its result is kept.

    Args:
        scope: the module's ``compile_scope``.
        compile_eval: whether validation compiles its own graph (at the first validation).
    """
    what = "the model" if scope == "model" else "each transformer block and the head"
    evaluation = (
        "validation compiles its own graph at the first validation" if compile_eval
        else "validation runs eager (--model.compile_eval true compiles it too)"
    )
    return (
        f"torch.compile: compiling {what} in the first training step, which takes longer; cached "
        f"afterwards in {inductor_cache_dir()}, so later runs start faster. {evaluation[0].upper()}{evaluation[1:]}."
    )
