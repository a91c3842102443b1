"""Which scaled-dot-product-attention kernel the training forward takes: cuDNN's on the GPUs where it
is the fast one (Hopper and newer), SDPA's math in a compiled step on a CPU at short sequences, SDPA's
own choice elsewhere. Decode never runs under it."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# Sequences up to this long train faster compiled on a CPU in bf16 with SDPA's math backend (two batched
# matmuls and a softmax that inductor fuses) than with the flash kernel, whose backward ran tiny-cpu's
# attention at 28 GFLOP/s: 8-14% a step at 128 positions, within the spread at 256, even or slower at
# 512, 24% slower at 1,024 (docs/benchmarks.md). Float32 and eager keep flash: even there in float32,
# for 3-4 s more of a cold compile; SDPA's eager math upcasts bf16 and keeps the (T, T) probabilities.
CPU_COMPILED_MATH_MAX_LEN = 128


def training_attention_backends(
    device_type: str,
    capability: tuple[int, int] | None,
    cudnn_attention: bool,
    *,
    seq_len: int | None = None,
    static_graph: bool = False,
    dtype: torch.dtype | None = None,
) -> list[SDPBackend] | None:
    """SDPA's backends in priority order for the training forward: cuDNN first (then flash, efficient, math)
    on a CUDA GPU of compute capability >= 9.0 that has it; math alone in a bf16 (``dtype``) CPU step compiled
    for its length alone (``static_graph``) of at most ``CPU_COMPILED_MATH_MAX_LEN`` positions; else None,
    SDPA's own order (Ampere: flash is as fast). Decode stays off cuDNN: it plans a graph per key length."""
    short = seq_len is not None and seq_len <= CPU_COMPILED_MATH_MAX_LEN
    if device_type == "cpu" and static_graph and short and dtype == torch.bfloat16:
        return [SDPBackend.MATH]
    if device_type != "cuda" or capability is None or capability < (9, 0) or not cudnn_attention:
        return None
    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def device_attention_backends(
    device: torch.device,
    *,
    seq_len: int | None = None,
    static_graph: bool = False,
    dtype: torch.dtype | None = None,
    cudnn_attention: bool = True,
) -> list[SDPBackend] | None:
    """``training_attention_backends`` for a step on ``device``, asked of the device and of cuDNN (>= 9
    has attention): ``seq_len`` positions a row, ``static_graph`` where the step runs a compiled graph
    traced for that length alone, ``dtype`` its attention's, ``cudnn_attention`` the module's switch."""
    if device.type != "cuda":
        return training_attention_backends(
            device.type, None, False, seq_len=seq_len, static_graph=static_graph, dtype=dtype
        )
    cudnn = cudnn_attention and torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000
    capability = torch.cuda.get_device_capability(device)
    return training_attention_backends(
        "cuda", capability, cudnn, seq_len=seq_len, static_graph=static_graph, dtype=dtype
    )


def attention_context(backends: list[SDPBackend] | None) -> AbstractContextManager:
    """The context the training forward runs in: ``sdpa_kernel(backends)`` in that priority, or nothing.
    Entered outside the compiled regions (one inside a compiled graph bypasses AOTAutograd's cache,
    pytorch#194007); the kernel is chosen when the graph is traced, in the first step. The order is also
    written into torch.compile's cache key (``torch.compiler.config.cache_key_tag``), which does not
    hold it otherwise: a warm cache would replay the kernel another run's choice compiled in."""
    if not backends:
        return contextlib.nullcontext()
    order = ",".join(backend.name for backend in backends)
    context = contextlib.ExitStack()
    context.enter_context(sdpa_kernel(backends, set_priority=True))
    context.enter_context(
        torch.compiler.config.patch(cache_key_tag=f"{torch.compiler.config.cache_key_tag}sdpa:{order}")
    )
    return context
