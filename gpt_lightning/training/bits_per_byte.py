"""Bits per byte: cross-entropy in bits over the UTF-8 bytes of the targets, comparable across tokenizers."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torchmetrics import Metric

from gpt_lightning.data.tokenizer import gpt2_encoding


@functools.lru_cache(maxsize=4)
def token_byte_lengths(vocab_size: int) -> torch.Tensor:
    """UTF-8 bytes (vocab_size,) of each GPT-2 token id, on the CPU; 0 for special and padded ids."""
    encoding = gpt2_encoding()
    tokens = range(min(vocab_size, encoding.n_vocab))
    lengths = torch.zeros(vocab_size, dtype=torch.long)
    lengths[: len(tokens)] = torch.tensor([len(text) for text in encoding.decode_tokens_bytes(tokens)])
    for name in encoding.special_tokens_set:
        lengths[encoding.encode_single_token(name)] = 0
    return lengths


def bits_and_bytes(
    logits: torch.Tensor, targets: torch.Tensor, byte_lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy in bits of ``targets`` (B, T) under ``logits`` (B, T, V), over the
    targets that decode to text, and their bytes: two scalars on the device, no host read."""
    losses = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")  # (B*T,)
    nbytes = byte_lengths[targets.flatten()]  # (B*T,)
    bits = torch.where(nbytes > 0, losses, 0.0).sum() / math.log(2)
    return bits, nbytes.sum()


class BitsPerByte(Metric):
    """Bits over bytes, each summed over batches and, at ``compute()``, over ranks (sum over sum)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("bits", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("bytes", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")  # exact to 2**53

    def update(self, bits: torch.Tensor, nbytes: torch.Tensor) -> None:
        self.bits += bits.double()
        self.bytes += nbytes

    def compute(self) -> torch.Tensor:
        return (self.bits / self.bytes).float()


@torch.no_grad()
def text_bits_per_byte(model: torch.nn.Module, ids: list[int], device: torch.device, batch_size: int = 8) -> dict:
    """``bpb``, ``bits``, ``bytes`` and ``tokens`` of a text's token ids under ``model``, in the harness's
    rolling windows (the first from ``<|endoftext|>``), ``batch_size`` windows per forward pass."""
    if not ids:
        raise ValueError("no tokens to score")
    T, N = model.config.block_size, len(ids)
    stream = torch.tensor([gpt2_encoding().eot_token, *ids])  # (N + 1,): position i predicts i + 1
    lengths = token_byte_lengths(model.config.vocab_size).to(device)
    whole = list(range(0, N - T + 1, T))  # first input positions of the windows of T predictions
    passes = [(whole[i : i + batch_size], T) for i in range(0, len(whole), batch_size)]
    if N % T:  # the rest: its last N % T positions scored, after as much input as fits
        passes.append(([max(0, N - T)], N % T))
    bits = torch.zeros((), dtype=torch.float64, device=device)
    nbytes = torch.zeros((), dtype=torch.long, device=device)
    for starts, scored in passes:
        width = min(T, N)
        x = torch.stack([stream[s : s + width] for s in starts]).to(device)  # (B, width)
        y = torch.stack([stream[s + 1 : s + 1 + width] for s in starts]).to(device)  # (B, width)
        window_bits, window_bytes = bits_and_bytes(model(x)[0][:, -scored:], y[:, -scored:], lengths)
        bits += window_bits.double()
        nbytes += window_bytes
    bits_value, bytes_value = bits.item(), int(nbytes.item())
    return {"bpb": bits_value / bytes_value, "bits": bits_value, "bytes": bytes_value, "tokens": N}
