"""Which scaled-dot-product-attention kernel the training forward takes: cuDNN's on the GPUs where it
is the fast one (Hopper and newer), SDPA's own choice elsewhere. Decode never runs under it."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def training_attention_backends(
    device_type: str, capability: tuple[int, int] | None, cudnn_attention: bool
) -> list[SDPBackend] | None:
    """SDPA's backends in priority order for the training forward: cuDNN attention first on a CUDA GPU
    of compute capability >= 9.0 that has it, then flash, memory-efficient and math as fallbacks for
    shapes it refuses; None (SDPA's own order, cuDNN last) elsewhere: a CPU, or Ampere, where flash is
    as fast. Decode stays off cuDNN: it plans a graph per key length."""
    if device_type != "cuda" or capability is None or capability < (9, 0) or not cudnn_attention:
        return None
    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def device_attention_backends(device: torch.device) -> list[SDPBackend] | None:
    """``training_attention_backends`` for ``device``, asked of the device and of cuDNN (>= 9 has attention)."""
    if device.type != "cuda":
        return None
    cudnn = torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000
    return training_attention_backends("cuda", torch.cuda.get_device_capability(device), cudnn)


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
