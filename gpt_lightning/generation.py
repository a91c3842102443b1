"""Sampling text from a ``GPT``: KV-cached decoding, the sliding window past ``block_size``, the
sampler, and a compiled decode step.

The prompt goes through the blocks once (prefill, ``GPT.forward_cached`` filling one ``KVCache`` per
block), then each new token alone (decode), attending to the cached keys and values. The model's
training ``forward`` is left as it is, and no layer of the model is changed while sampling.

    from gpt_lightning.generation import generate
    out = generate(model, idx, 100, temperature=0.8, top_k=200)   # (B, T + 100) token ids
"""

from __future__ import annotations

import functools
import math
import types
import weakref
from typing import Callable

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
    use_cache: bool = True,
    compile: bool = False,
) -> torch.Tensor:
    """Extend ``idx`` (B, T) by sampling ``max_new_tokens`` tokens from ``model``, all B rows in one batch.

    With the cache (the default), the context goes through the blocks once and each new token
    alone, attending to the cached keys and values. Each token is predicted from at most
    ``block_size`` tokens: a longer prompt is cut to its last ``block_size``, and when the cache
    is full the window slides, keeping its last ``block_size // 2`` tokens (positions restart
    at 0, so they are prefilled again) and filling up once more: one prefill every
    ``block_size // 2`` tokens instead of a full forward pass for each token. Nothing is read
    back to the host until the tokens are returned.

    Args:
        model: the GPT to sample from (in eval mode: dropout would apply otherwise).
        idx: prompt token ids, shape (B, T), T >= 1.
        max_new_tokens: how many tokens to append.
        temperature: softmax temperature; 0 means greedy (argmax).
        top_k: sample only among the k most likely tokens; None for the whole vocabulary.
        generator: random generator for reproducible samples (on ``idx``'s device).
        vocab_limit: sample only ids below this: the tokenizer's size when the embedding is
            padded past it (50304 rows for GPT-2's 50257 tokens), so every id decodes.
        use_cache: False recomputes the last ``block_size`` tokens' forward pass for each new
            token (the reference the cache is tested against; slow).
        compile: run each decode step through ``torch.compile`` (static shapes; CUDA graphs on
            CUDA; on a CPU inductor freezes the weights into its own matmul layout). It compiles
            at the first call, so it pays only for long or repeated generations.

    Returns:
        token ids of shape (B, T + max_new_tokens).
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}.")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None, got {top_k}.")
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError(f"idx must be token ids of shape (B, T) with T >= 1, got shape {tuple(idx.shape)}.")
    sample = Sampler(temperature, top_k, generator, vocab_limit)
    if use_cache:
        return _generate_cached(model, idx, max_new_tokens, sample, compile)
    # Eager, even when the model or its blocks are compiled for fixed (B, T) training shapes:
    # every new length would otherwise be a recompilation.
    with torch.compiler.set_stance("force_eager"):
        for _ in range(max_new_tokens):
            logits, _ = model(idx[:, -model.config.block_size :])  # (B, <=block_size, V)
            idx = torch.cat((idx, sample(logits[:, -1])), dim=1)  # (B, T+1)
    return idx


def _generate_cached(model: GPT, idx: torch.Tensor, max_new_tokens: int, sample: "Sampler", compile: bool) -> torch.Tensor:
    # forward_cached is not the compiled __call__ of the model or its blocks (training's
    # torch.compile): it runs eager unless `compile` asks for a decode graph of its own.
    B, T = idx.shape
    out = torch.empty((B, T + max_new_tokens), dtype=idx.dtype, device=idx.device)  # (B, T + N)
    out[:, :T] = idx
    if max_new_tokens == 0:
        return out
    block_size = model.config.block_size
    max_len = min(block_size, T + max_new_tokens)
    keep = max(1, block_size // 2)  # tokens a full window keeps when it slides
    caches = decode_caches(model, B, max_len, idx.device) if compile else [KVCache(max_len) for _ in model.transformer.h]
    positions = torch.arange(max_len, device=idx.device)  # (max_len,)
    pos = torch.zeros(1, dtype=torch.long, device=idx.device)  # (1,): the decode step's position
    step = compiled_decode_step(model) if compile else model.forward_cached
    start = max(0, T - block_size)  # the window: out[:, start:end] is in the cache
    logits = model.forward_cached(out[:, start:T], caches, positions[: T - start])  # prefill
    if compile and idx.is_cuda:  # the caches exist now and stay where they are: CUDA graphs may keep their addresses
        # (not on a CPU: with freezing, a static input would be frozen into the graph like a weight).
        # The same caches serve every call of this model, batch and length: one graph, not one per call.
        for cache in caches:
            torch._dynamo.mark_static_address(cache.k)
            torch._dynamo.mark_static_address(cache.v)
    for end in range(T, T + max_new_tokens):
        out[:, end : end + 1] = sample(logits)  # (B, 1)
        if end + 1 == T + max_new_tokens:
            break
        length = end - start  # tokens in the cache
        if length == max_len:  # full: slide the window and prefill it again
            start = end + 1 - keep
            logits = model.forward_cached(out[:, start : end + 1], caches, positions[:keep])
            continue
        pos.fill_(length)  # on the device: no host read, the same tensor for a compiled step
        if compile:
            logits = step(out[:, end : end + 1], caches, pos)  # all max_len positions, masked
        else:
            logits = step(out[:, end : end + 1], caches, pos, length + 1)
    return out


def compiled_decode_step(model: GPT) -> Callable[..., torch.Tensor]:
    """``model.forward_cached`` for one token, compiled once per model (static shapes: the same
    graph at every position). On CUDA, ``reduce-overhead`` replays it as a CUDA graph. On a CPU,
    inductor's freezing treats the weights as constants and packs them for MKL's matmul once (the
    decode-time weight layout a skinny matmul needs, which the eager path cannot do): 1.24x eager
    and 1.28x ``transformers`` at batch 1 on a 2-core CPU (docs/benchmarks.md). Packed weights are
    copies: once a weight has changed (training goes on), the next call compiles a new step."""
    cuda = model.lm_head.weight.is_cuda
    weights = None if cuda else _weights_key(model)
    held = _DECODE_STEPS.get(model)
    if held is None or held[1] != weights:
        # A copy of _decode with a code object of its own: dynamo keeps compiled graphs per code
        # object, so each model (and each version of its weights) has its own within torch's
        # recompile limit, and the packed weights of an old version are freed with it.
        decode = types.FunctionType(_decode.__code__.replace(), _decode.__globals__, _decode.__name__)
        held = (torch.compile(decode, mode="reduce-overhead" if cuda else None, fullgraph=True, dynamic=False), weights)
        _DECODE_STEPS[model] = held  # not an attribute of the model: it deep-copies and pickles as before
    step = held[0]
    if cuda:
        return functools.partial(step, model)

    def frozen(idx: torch.Tensor, caches: list[KVCache], pos: torch.Tensor) -> torch.Tensor:
        # torch.compile(options={"freezing": True}) does not freeze on torch 2.13 (its output code
        # multiplied the plain weights): inductor reads the flag from its config while compiling,
        # which happens at the first call.
        with torch._inductor.config.patch(freezing=True):
            return step(model, idx, caches, pos)
    return frozen


# Each model's compiled decode step and the key of the weights it froze (None on CUDA).
_DECODE_STEPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Each model's KV caches for its compiled decode step, per (batch, length, device, dtype).
_DECODE_CACHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def decode_caches(model: GPT, batch: int, max_len: int, device: torch.device) -> list[KVCache]:
    """The model's KV caches for a compiled decode of ``batch`` rows and ``max_len`` positions, the same
    tensors at every call with these: a CUDA graph reads its static inputs at fixed addresses, so fresh
    caches at each call would record a new graph each time. A prefill overwrites what a decode step
    attends to, and the step masks the positions past it, so what an earlier call left is never read.
    They live as long as the model (one set per batch, length, device and dtype used)."""
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else model.lm_head.weight.dtype
    held = _DECODE_CACHES.setdefault(model, {})
    key = (batch, max_len, device, dtype)
    if key not in held:
        held[key] = [KVCache(max_len) for _ in model.transformer.h]
    return held[key]


def _weights_key(model: GPT) -> tuple:
    """Changes when any weight is written in place (its version) or replaced (its storage)."""
    parameters = list(model.parameters())
    return tensor_versions(parameters), tuple(p.data_ptr() for p in parameters)


def _decode(model: GPT, idx: torch.Tensor, caches: list[KVCache], pos: torch.Tensor) -> torch.Tensor:
    return model.forward_cached(idx, caches, pos)  # (B, vocab_size)


class Sampler:
    """The next token (B, 1) from next-token logits (B, V): greedy at temperature 0, else a draw
    from the softmax of logits / temperature over the ``top_k`` likeliest ids below ``vocab_limit``."""

    def __init__(self, temperature: float, top_k: int | None, generator: torch.Generator | None, vocab_limit: int | None):
        self.temperature, self.top_k, self.generator, self.vocab_limit = temperature, top_k, generator, vocab_limit

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits[:, : self.vocab_limit].float()  # (B, V)
        if self.temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        logits = logits / self.temperature
        if self.top_k is not None:
            kth = torch.topk(logits, min(self.top_k, logits.size(-1))).values[:, [-1]]  # (B, 1)
            logits = logits.masked_fill(logits < kth, -math.inf)
        probs = F.softmax(logits, dim=-1)  # (B, V)
        # torch.multinomial's one-sample draw (the same numbers from the same generator) without its
        # check that probs is a distribution, which reads a value back to the host (a CUDA sync).
        noise = torch.empty_like(probs).exponential_(1, generator=self.generator)  # (B, V)
        return (probs / noise).argmax(dim=-1, keepdim=True)  # (B, 1)
