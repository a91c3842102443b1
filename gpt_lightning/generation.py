"""Sampling text from a ``GPT``: KV-cached decoding, the sliding window past ``block_size``, the
sampler, and a compiled decode step.

The prompt goes through the blocks once (prefill, ``GPT.forward_cached`` filling one ``KVCache`` per
block), then each new token alone (decode), attending to the cached keys and values. The model's
training ``forward`` is left as it is, and no layer of the model is changed while sampling.

    from gpt_lightning.generation import generate
    out = generate(model, idx, 100, temperature=0.8, top_k=200)   # (B, T + 100) token ids
    out = generate(model, idx, 100, temperature=0.8, top_p=0.9)   # nucleus sampling
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch._inductor.config
import torch.nn.functional as F

from gpt_lightning.lightning_internals import tensor_versions
from gpt_lightning.model import GPT, KVCache


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    vocab_limit: int | None = None,
    *,
    top_p: float | None = None,
    use_cache: bool = True,
    compile: bool = False,
) -> torch.Tensor:
    """Extend ``idx`` (B, T) by ``max_new_tokens`` tokens sampled from ``model``, all B rows in one batch.

    Each token sees at most ``block_size`` tokens: a longer prompt keeps its last ``block_size``, and a
    full KV cache slides to its last ``block_size // 2`` tokens. Nothing is read back to the host
    until the tokens are returned.

    Args:
        model: the GPT to sample from (in eval mode: dropout would apply otherwise).
        idx: prompt token ids, shape (B, T), T >= 1.
        max_new_tokens: how many tokens to append.
        temperature: softmax temperature; 0 means greedy (argmax).
        top_k: sample only among the k most likely tokens; None for the whole vocabulary.
        generator: random generator for reproducible samples (on ``idx``'s device).
        vocab_limit: sample only ids below this: the tokenizer's size when the embedding is
            padded past it (50304 rows for GPT-2's 50257 tokens), so every id decodes.
        top_p: nucleus sampling: only the likeliest ids whose probabilities add up to ``top_p``
            (after ``top_k``); None or 1 for all of them.
        use_cache: False recomputes the last ``block_size`` tokens' forward pass for each new
            token (the reference the cache is tested against; slow).
        compile: compile the decode step once per batch size (CUDA graphs on CUDA, frozen weights
            on a CPU, autotuned at batch 1; docs/sampling.md): pays for long or repeated generations.

    Returns:
        token ids of shape (B, T + max_new_tokens).
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}.")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}.")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p}.")
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError(f"idx must be token ids of shape (B, T) with T >= 1, got shape {tuple(idx.shape)}.")
    sample = Sampler(temperature, top_k, generator, vocab_limit, top_p)
    if use_cache:
        return _generate_cached(model, idx, max_new_tokens, sample, compile)
    # Eager, even when the model or its blocks are compiled for fixed (B, T) training shapes:
    # every new length would otherwise be a recompilation.
    with torch.compiler.set_stance("force_eager"):
        for _ in range(max_new_tokens):
            logits, _ = model(idx[:, -model.config.block_size :])  # (B, <=block_size, V)
            idx = torch.cat((idx, sample(logits[:, -1])), dim=1)  # (B, T+1)
    return idx


def _generate_cached(
    model: GPT, idx: torch.Tensor, max_new_tokens: int, sample: Sampler, compile: bool
) -> torch.Tensor:
    # forward_cached is not the compiled __call__ of the model or its blocks (training's
    # torch.compile): it runs eager unless `compile` asks for a decode graph of its own.
    B, T = idx.shape
    out = torch.empty((B, T + max_new_tokens), dtype=idx.dtype, device=idx.device)  # (B, T + N)
    out[:, :T] = idx
    if max_new_tokens == 0:
        return out
    block_size = model.config.block_size
    max_len = min(block_size, T + max_new_tokens)  # positions the window holds
    keep = max(1, block_size // 2)  # tokens a full window keeps when it slides
    if compile:  # caches of a power of two positions (a few lengths, a graph each), the step masking those past its own
        cache_len = min(block_size, max(64, 1 << (max_len - 1).bit_length()))
        step, caches = compiled_decoding(model, B, cache_len, idx.device)
    else:
        step, caches = model.forward_cached, [KVCache(max_len) for _ in model.transformer.h]
    positions = torch.arange(max_len, device=idx.device)  # (max_len,)
    pos = torch.zeros(1, dtype=torch.long, device=idx.device)  # (1,): the decode step's position
    token = torch.empty(
        (B, 1), dtype=idx.dtype, device=idx.device
    )  # (B, 1): its token, strides unchanged at any length
    start = max(0, T - block_size)  # the window: out[:, start:end] is in the cache
    logits = model.forward_cached(out[:, start:T], caches, positions[: T - start])  # prefill
    if compile and idx.is_cuda:  # the caches exist now and stay where they are: CUDA graphs keep their addresses
        for tensor in (t for cache in caches for t in cache.tensors()):  # keys and values
            torch._dynamo.mark_static_address(tensor)
    elif compile and B > 1:  # one CPU graph for every batch size above 1 (see compiled_decoding)
        for tensor in (token, *(t for cache in caches for t in cache.tensors())):
            torch._dynamo.mark_dynamic(tensor, 0)
    # On a CPU, inductor freezes the weights while it compiles (at the first step); the option must be
    # on while dynamo traces too, so torch.compile(options=...) cannot do it. At batch 1, max_autotune
    # times inductor's C++ GEMM templates against MKL's and oneDNN's kernels for each matmul and keeps
    # the faster: 124M decoded 1.9x (float32) and 1.4x (bfloat16) faster; at batch 8 it gained nothing.
    # The C++ wrapper calls the step's kernels without a Python line each (docs/sampling.md).
    cpu_options = torch._inductor.config.patch(
        freezing=True,
        cpp_wrapper=True,
        max_autotune=B == 1,
        autotune_num_choices_displayed=0,  # the timings' tables stay off the user's console
        max_autotune_report_choices_stats=False,
    )
    with cpu_options if compile and not idx.is_cuda else contextlib.nullcontext():
        for end in range(T, T + max_new_tokens):
            out[:, end : end + 1] = token.copy_(sample(logits))  # (B, 1)
            if end + 1 == T + max_new_tokens:
                break
            length = end - start  # tokens in the cache
            if length == max_len:  # full: slide the window and prefill it again
                start = end + 1 - keep
                logits = model.forward_cached(out[:, start : end + 1], caches, positions[:keep])
                continue
            pos.fill_(length)  # on the device: no host read, the same tensor for a compiled step
            if compile:
                logits = step(token, caches, pos)  # all the caches' positions, masked
            else:
                logits = step(token, caches, pos, length + 1)
    return out


@dataclass
class CompiledDecoding:
    """A model's compiled decode steps and their KV caches, for the weights a CPU step froze."""

    # The weights when the steps froze them (a CPU): other weights need other steps. None on CUDA.
    weights: tuple | None
    # torch.compile of a copy of _decode, (model, idx (B, 1), caches, pos (1,)) -> logits (B, V), per
    # (batch size: on a CPU only whether it is 1, cache length, device, dtype).
    steps: dict[tuple, Callable[..., torch.Tensor]] = field(default_factory=dict)
    # Caches per (batch, length, device, dtype): the same tensors at every call.
    caches: dict[tuple, list[KVCache]] = field(default_factory=dict)


# Each model's compiled decoding, held beside the model: it deep-copies and pickles as before.
_COMPILED: weakref.WeakKeyDictionary[GPT, CompiledDecoding] = weakref.WeakKeyDictionary()


def compiled_decoding(
    model: GPT, batch: int, length: int, device: torch.device
) -> tuple[Callable[..., torch.Tensor], list[KVCache]]:
    """The model's compiled decode step for ``batch`` rows, caches of ``length`` positions and this
    call's dtype, and those caches; compiled again once the weights a CPU step froze have changed."""
    cuda = device.type == "cuda"
    weights = None if cuda else _weights_key(model)
    decoding = _COMPILED.get(model)
    if decoding is None or decoding.weights != weights:
        decoding = _COMPILED[model] = CompiledDecoding(weights)
    dtype = model.compute_dtype(device.type)
    if (batch, length, device, dtype) not in decoding.caches:
        decoding.caches[batch, length, device, dtype] = [KVCache(length) for _ in model.transformer.h]
    # CUDA graphs record static shapes: a graph per batch size. On a CPU, batch 1 has static shapes
    # (its matmuls autotuned: _generate_cached) and larger batches share a graph with a dynamic batch
    # size (inductor packs the weights for oneDNN's matmul, faster there than MKL's: docs/sampling.md).
    key = (batch if cuda else batch > 1, length, device, dtype)
    if key not in decoding.steps:
        # A copy of _decode with a code object of its own: dynamo keeps graphs per code object, so this
        # one holds a single graph, freed with it (frozen weights included), and never meets torch's recompile limit.
        decode = types.FunctionType(_decode.__code__.replace(), _decode.__globals__, _decode.__name__)
        decoding.steps[key] = torch.compile(
            decode, mode="reduce-overhead" if cuda else None, fullgraph=True, dynamic=False
        )
    return functools.partial(decoding.steps[key], model), decoding.caches[batch, length, device, dtype]


def _weights_key(model: GPT) -> tuple:
    """Changes when any weight is written in place (its version) or replaced (its storage)."""
    parameters = list(model.parameters())
    return tensor_versions(parameters), tuple(p.data_ptr() for p in parameters)


def _decode(model: GPT, idx: torch.Tensor, caches: list[KVCache], pos: torch.Tensor) -> torch.Tensor:
    return model.forward_cached(idx, caches, pos)  # (B, vocab_size)


class Sampler:
    """The next token (B, 1) from next-token logits (B, V): greedy at temperature 0, else a draw
    from the softmax of logits / temperature over the ``top_k`` likeliest ids below ``vocab_limit``,
    cut to the nucleus of probability ``top_p`` (the fewest likeliest ids that reach it)."""

    def __init__(
        self,
        temperature: float,
        top_k: int | None,
        generator: torch.Generator | None,
        vocab_limit: int | None,
        top_p: float | None = None,
    ):
        self.temperature, self.top_k, self.generator, self.vocab_limit = temperature, top_k, generator, vocab_limit
        self.top_p = top_p if top_p is not None and top_p < 1 else None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits[:, : self.vocab_limit].float()  # (B, V)
        if self.temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        logits = logits / self.temperature
        if self.top_k is not None:
            kth = torch.topk(logits, min(self.top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
            logits = logits.masked_fill(logits < kth, -math.inf)
        probs = F.softmax(logits, dim=-1)  # (B, V)
        if self.top_p is not None:
            sorted_probs, order = probs.sort(dim=-1, descending=True)  # (B, V) each
            outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= self.top_p  # the mass before it reaches top_p
            probs = probs.masked_fill(outside.scatter(1, order, outside), 0.0)  # (B, V); the likeliest id always stays
        # torch.multinomial's one-sample draw (the same numbers from the same generator) without its
        # check that probs is a distribution, which reads a value back to the host (a CUDA sync).
        noise = torch.empty_like(probs).exponential_(1, generator=self.generator)  # (B, V)
        return (probs / noise).argmax(dim=-1, keepdim=True)  # (B, 1)
