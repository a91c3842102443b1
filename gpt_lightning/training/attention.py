"""Which SDPA kernel the training forward takes: cuDNN's on Hopper and newer where asked for
(``cudnn_attention``), SDPA's own choice elsewhere."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def training_attention_backends(
    device_type: str, capability: tuple[int, int] | None, cudnn_attention: bool
) -> list[SDPBackend] | None:
    """SDPA's backends in priority order for the training forward: cuDNN first on a CUDA GPU of
    capability >= 9.0 that has it, where ``cudnn_attention`` asks for it; else None, SDPA's own order."""
    if device_type != "cuda" or capability is None or capability < (9, 0) or not cudnn_attention:
        return None
    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def device_attention_backends(device: torch.device, *, cudnn_attention: bool = False) -> list[SDPBackend] | None:
    """``training_attention_backends`` for a step on ``device``, asking it and cuDNN (>= 9 has attention)."""
    if device.type != "cuda" or not cudnn_attention:
        return None
    cudnn = torch.backends.cudnn.is_available() and (torch.backends.cudnn.version() or 0) >= 90000
    return training_attention_backends("cuda", torch.cuda.get_device_capability(device), cudnn)


def attention_context(backends: list[SDPBackend] | None) -> AbstractContextManager:
    """``sdpa_kernel(backends)`` in that priority, or nothing; entered outside the compiled regions. The
    order goes into torch.compile's cache key too, else a warm cache would replay another run's kernel."""
    if not backends:
        return contextlib.nullcontext()
    order = ",".join(backend.name for backend in backends)
    context = contextlib.ExitStack()
    context.enter_context(sdpa_kernel(backends, set_priority=True))
    context.enter_context(
        torch.compiler.config.patch(cache_key_tag=f"{torch.compiler.config.cache_key_tag}sdpa:{order}")
    )
    return context
