"""The GPT's architecture: ``GPTConfig`` (GPT-2 124M by default, one "why" comment a field) and the modern
switches that move it away from GPT-2 (docs/modern.md). Plain Python: no torch needed to read or check one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

# The value-embedding gate reads the first this many channels of the attention's input (nanochat's 12).
VALUE_GATE_CHANNELS = 12


@dataclass
class GPTConfig:
    """Architecture of a GPT-2 style decoder. The defaults are GPT-2 124M (124,439,808 parameters)."""

    # Longest sequence the model can see: the size of the learned position-embedding table.
    block_size: int = 1024
    # Token-embedding rows: the GPT-2 BPE has 50,000 merges + 256 byte tokens + <|endoftext|>.
    # Padding it to a multiple of 64 (50304) makes the LM-head matmul faster on GPUs.
    vocab_size: int = 50257
    # Number of transformer blocks: depth.
    n_layer: int = 12
    # Attention heads per block; n_embd must divide evenly among them.
    n_head: int = 12
    # Width of the residual stream.
    n_embd: int = 768
    # Dropout on attention weights, residual branches and embeddings. GPT-2 pre-training used 0.1;
    # 0.0 is best for short runs and is what the reference experiment uses.
    dropout: float = 0.0
    # Biases in Linear and LayerNorm layers, as GPT-2 has them. False is slightly faster.
    bias: bool = True
    # --- Modern switches (docs/modern.md). Each default is GPT-2's; configs/modern-*.yaml turn them on. ---
    # Rotary position embeddings on queries and keys instead of the learned table: relative positions, no wpe.
    rotary: bool = False
    # Rotary base (the longest wavelength, in positions): 10000 as in RoFormer and nanochat.
    rotary_base: float = 10000.0
    # RMSNorm instead of LayerNorm (no mean subtraction, cheaper); with rmsnorm the embedding is normed too.
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    # Learned gains (and biases, with bias) in the norms; False makes them parameter-free, as nanochat's.
    norm_affine: bool = True
    # RMS-normalize each head's queries and keys: bounded attention logits, so higher learning rates stay stable.
    qk_norm: bool = False
    # The MLP's nonlinearity: GPT-2's tanh-GELU, or ReLU squared (modded-nanogpt: fewer tokens to a loss).
    activation: Literal["gelu", "relu2"] = "gelu"
    # Share the LM head with the token embedding (GPT-2); untied, each gets its own weights and rate.
    tie_embeddings: bool = True
    # Start the residual output projections (attn.c_proj, mlp.c_proj) and an untied head at zero (modded-nanogpt).
    zero_init_proj: bool = False
    # Logits squashed to (-c, c) by c * tanh(logits / c) (modded-nanogpt: 30; Gemma 2); None: none.
    logit_softcap: float | None = None
    # nanochat's value embeddings (ResFormer): every other block, the last included, adds a token-indexed
    # table to its attention values through a per-head gate; extra parameters for a lower loss per token.
    value_embeddings: bool = False
    # Sliding-window attention, nanochat's window_pattern: one letter a block, the string tiled over the
    # blocks, S a short window, L the whole context, the last block always L. "L": GPT-2's attention.
    window_pattern: str = "L"
    # An S block's window W as a fraction of block_size, rounded up (nanochat's quarter, without its round
    # up to a 128-token tile): a query at position i sees the keys at i - W to i; W = 16 at T = 64, 32 at 128.
    short_window_fraction: float = 0.25
    # nanochat's per-layer residual scalars (after modded-nanogpt's block lambdas):
    # before block i, x = resid_lambdas[i] * x + x0_lambdas[i] * x0, x0 the blocks' input (the normed
    # embedding): every block can re-read the tokens and rescale the stream; 2 x n_layer learned scalars.
    residual_scalars: bool = False

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}.")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): "
                "each head gets n_embd // n_head channels."
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}.")
        if self.norm not in ("layernorm", "rmsnorm"):
            raise ValueError(f"GPTConfig.norm must be layernorm or rmsnorm, got {self.norm!r}.")
        if self.activation not in ("gelu", "relu2"):
            raise ValueError(f"GPTConfig.activation must be gelu or relu2, got {self.activation!r}.")
        if self.rotary and (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"GPTConfig.rotary needs an even head size, got n_embd // n_head = {self.n_embd // self.n_head}."
            )
        if self.logit_softcap is not None and self.logit_softcap <= 0:
            raise ValueError(f"GPTConfig.logit_softcap must be positive or null, got {self.logit_softcap}.")
        if self.value_embeddings and self.n_embd < VALUE_GATE_CHANNELS:
            raise ValueError(
                f"GPTConfig.value_embeddings needs n_embd >= {VALUE_GATE_CHANNELS} (the gate reads that "
                f"many channels), got {self.n_embd}."
            )
        if not self.window_pattern or set(self.window_pattern) - {"S", "L"}:
            raise ValueError(f"GPTConfig.window_pattern must be letters S and L, got {self.window_pattern!r}.")
        if not 0.0 < self.short_window_fraction <= 1.0:
            raise ValueError(f"GPTConfig.short_window_fraction must be in (0, 1], got {self.short_window_fraction}.")

    def has_value_embedding(self, layer: int) -> bool:
        """Whether block ``layer`` gets a value embedding: every other block, counted back from the last (nanochat)."""
        return self.value_embeddings and layer % 2 == (self.n_layer - 1) % 2

    def attention_window(self, layer: int) -> int | None:
        """Block ``layer``'s window W (a query at position i sees the keys at i - W to i), or None: the whole
        causal context (an L block, the last block, or a window that reaches back to position 0 anyway)."""
        if layer == self.n_layer - 1 or self.window_pattern[layer % len(self.window_pattern)] == "L":
            return None
        window = math.ceil(self.short_window_fraction * self.block_size - 1e-9)  # 0.1 x 30 is 3.0000000000000004
        return window if window < self.block_size - 1 else None


MODERN_SWITCHES = (
    "rotary",
    "norm",
    "norm_affine",
    "qk_norm",
    "activation",
    "tie_embeddings",
    "zero_init_proj",
    "logit_softcap",
    "value_embeddings",
    "window_pattern",
    "residual_scalars",
)


def modern_switches_on(config: GPTConfig) -> list[str]:
    """The modern switches ``config`` sets away from GPT-2's defaults that Hugging Face GPT-2 cannot
    hold (``zero_init_proj`` changes only the starting weights, not the layout: not one of them)."""
    default = GPTConfig()
    return [
        name
        for name in MODERN_SWITCHES
        if name != "zero_init_proj" and getattr(config, name) != getattr(default, name)
        if name != "window_pattern" or any(config.attention_window(i) is not None for i in range(config.n_layer))
    ]
