"""Which SDPA kernel the training forward takes: cuDNN's on Hopper and newer, math in a short compiled
bf16 CPU step, SDPA's own choice elsewhere (docs/benchmarks.md)."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# Up to this length a compiled bf16 CPU step is faster with SDPA's math (which inductor fuses) than flash.
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
    """SDPA's backends in priority order for the training forward: cuDNN first on a CUDA GPU of
    capability >= 9.0 that has it; math alone in a short bf16 CPU step compiled for its length alone
    (``static_graph``); else None, SDPA's own order."""
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
    """``training_attention_backends`` for a step on ``device``, asking it and cuDNN (>= 9 has attention)."""
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
