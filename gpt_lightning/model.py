"""GPT-2 as a plain ``nn.Module`` (no Lightning in here, so the weights work anywhere), with OpenAI's
parameter names; ``forward_cached`` runs tokens through one ``KVCache`` per block, for generation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

from gpt_lightning.config import VALUE_GATE_CHANNELS, GPTConfig
from gpt_lightning.precision import compute_dtype

# The GPT's own learned scalars, outside the blocks (residual_scalars): AdamW without weight decay, never Muon
# (training/optimizers.py), as nanochat trains them with Adam.
SCALAR_PARAMETERS = ("resid_lambdas", "x0_lambdas")

# A training loss in place of the logits: (normed final states (N, C), the head's weight (V, C),
# targets (N,), logit_softcap) -> the mean cross-entropy; ``loss.chunked_cross_entropy`` is one.
HeadLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float | None], torch.Tensor]


@dataclass
class KVCache:
    """One layer's keys and values during generation, each (B, nh, max_len, hs), filled from position 0;
    allocated by the prefill in the keys' dtype (bf16 under autocast). Not module state (not in state_dict)."""

    # Positions the cache holds: the longest context a decode step attends to (<= block_size).
    max_len: int
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None

    def store(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Write keys and values (B, nh, T, hs) at positions ``pos`` (T,), on the device."""
        if self.k is None:
            B, nh, _, hs = k.shape
            self.k = k.new_zeros((B, nh, self.max_len, hs))  # (B, nh, max_len, hs)
            self.v = v.new_zeros((B, nh, self.max_len, hs))  # (B, nh, max_len, hs)
        self.k.index_copy_(2, pos, k)
        self.v.index_copy_(2, pos, v)


def _draw_(weight: torch.Tensor, draw: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """``draw`` (fills a CPU tensor in place) applied to ``weight``, through a whole CPU copy where it is not one."""
    if weight.device.type == "cpu" and not isinstance(weight, DTensor):
        with torch.no_grad():
            draw(weight)
        return
    whole = draw(torch.empty(weight.shape, dtype=weight.dtype, device="cpu"))
    if isinstance(weight, DTensor):  # this rank's shard of the whole; every rank draws the same
        whole = distribute_tensor(whole, weight.device_mesh, weight.placements, src_data_rank=None)
    with torch.no_grad():
        weight.copy_(whole)


def make_norm(config: GPTConfig) -> nn.Module:
    """The config's normalization over the channels: LayerNorm (GPT-2) or RMSNorm, with gains or without."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(config.n_embd, elementwise_affine=config.norm_affine)
    return nn.LayerNorm(config.n_embd, elementwise_affine=config.norm_affine, bias=config.bias and config.norm_affine)


def rotate(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary position embedding of ``x`` (B, nh, T, hs) at positions ``pos`` (T,) or (B, T): channel pairs
    (i, i + hs/2) turned by the angle pos * base^(-2i/hs), so that q . k depends on their distance only."""
    hs = x.size(-1)
    inv_freq = base ** (-torch.arange(0, hs, 2, device=x.device, dtype=torch.float32) / hs)  # (hs/2,)
    angles = pos.to(torch.float32)[..., None] * inv_freq  # (T, hs/2), or (B, T, hs/2) for positions per row
    if angles.dim() == 3:
        angles = angles.unsqueeze(1)  # (B, 1, T, hs/2): the same for every head
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)  # (T, hs/2) or (B, 1, T, hs/2) each
    x1, x2 = x[..., : hs // 2], x[..., hs // 2 :]  # (B, nh, T, hs/2) each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (B, nh, T, hs)


def in_window(query: torch.Tensor, key: torch.Tensor, window: int) -> torch.Tensor:
    """Whether a query at position ``query`` sees a key at ``key`` (broadcast): at or before it, at most
    ``window`` back (FlashAttention's ``window_size=(window, 0)``, as nanochat's SDPA fallback masks)."""
    return (key <= query) & (key >= query - window)


def windowed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, dropout_p: float
) -> torch.Tensor:
    """Causal attention of q, k, v (B, nh, T, hs) from position 0, each query seeing its last ``window`` + 1
    keys: (B, nh, T, hs). Compiled on CUDA, flex attention with a block mask (it skips the blocks outside
    the band; SDPA given a mask loses flash attention); elsewhere SDPA with the (T, T) boolean band."""
    T = q.size(-2)
    if q.is_cuda and torch.compiler.is_compiling() and dropout_p == 0.0:
        return flex_window(q, k, v, window)
    pos = torch.arange(T, device=q.device)  # (T,)
    band = in_window(pos[:, None], pos, window)  # (T, T)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band, dropout_p=dropout_p)


def flex_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """``windowed_attention`` by ``flex_attention`` (fast compiled; eager it runs an unfused reference)."""
    T = q.size(-2)
    block_mask = create_block_mask(lambda b, h, qi, ki: in_window(qi, ki, window), None, None, T, T, device=q.device)
    return flex_attention(q, k, v, block_mask=block_mask)  # (B, nh, T, hs)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.rotary_base = config.rotary_base if config.rotary else None
        self.qk_norm = config.qk_norm
        self.window = config.attention_window(layer)  # None: the whole causal context
        # query, key and value projections for all heads in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True  # marks it for the scaled GPT-2 init
        self.resid_dropout = nn.Dropout(config.dropout)
        self.value_embedding = self.value_gate = None
        if config.has_value_embedding(layer):
            # A token's own vector added to its values (one per layer that has one), and a per-head
            # gate in (0, 3) read off the input's first channels: how much of it each head takes.
            self.value_embedding = nn.Embedding(config.vocab_size, config.n_embd)
            self.value_gate = nn.Linear(VALUE_GATE_CHANNELS, config.n_head, bias=False)
            self.value_gate.gate_init = True  # marks it for its own (positive) init

    def heads(self, x: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor) -> list[torch.Tensor]:
        """Queries, keys and values of ``x`` (B, T, C), the tokens ``idx`` (B, T) at positions ``pos`` (T,) or (B, T),
        each split into heads: 3 x (B, nh, T, hs); the values plus the gated value embedding of ``idx``
        (``value_embeddings``), the queries and keys rotated (``rotary``) then normalized (``qk_norm``)."""
        B, T, C = x.shape  # batch, time, channels (n_embd)
        qkv = self.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
        q, k, v = [t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in qkv]  # 3 x (B, nh, T, hs)
        if self.value_embedding is not None:
            ve = self.value_embedding(idx).to(v.dtype)  # (B, T, C), in the values' dtype (bf16 under autocast)
            ve = ve.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
            gate = 3 * torch.sigmoid(self.value_gate(x[..., :VALUE_GATE_CHANNELS]))  # (B, T, nh), in (0, 3)
            v = v + gate.transpose(1, 2).unsqueeze(-1) * ve  # (B, nh, T, hs) + (B, nh, T, 1) * (B, nh, T, hs)
        if self.rotary_base is not None:
            q, k = rotate(q, pos, self.rotary_base), rotate(k, pos, self.rotary_base)  # (B, nh, T, hs)
        if self.qk_norm:
            q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))  # (B, nh, T, hs)
        return [q, k, v]

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.heads(x, idx, torch.arange(T, device=x.device))  # 3 x (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0.0
        if self.window is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)  # (B, nh, T, hs)
        else:
            y = windowed_attention(q, k, v, self.window, dropout_p)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side
        return self.resid_dropout(self.c_proj(y))

    def forward_cached(
        self, x: torch.Tensor, idx: torch.Tensor, cache: KVCache, pos: torch.Tensor, length: int | None
    ) -> torch.Tensor:
        """Attention for generation of ``x`` (B, T, C), tokens ``idx`` (B, T) at ``pos`` (T,): T > 1 is a causal
        prefill from position 0; T == 1 attends to the cache's first ``length`` positions (None: all of
        them, those after ``pos`` masked, static shapes for a compiled step); a windowed block to the last
        ``window`` + 1 of them."""
        B, T, C = x.shape
        q, k, v = self.heads(x, idx, pos)  # 3 x (B, nh, T, hs): the cache holds rotated keys, gated values
        cache.store(k, v, pos)
        if T > 1 and self.window is not None:
            y = windowed_attention(q, k, v, self.window, 0.0)  # (B, nh, T, hs)
        elif T > 1:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        elif length is not None:
            start = 0 if self.window is None else max(0, length - 1 - self.window)  # the query is at length - 1
            y = F.scaled_dot_product_attention(q, cache.k[:, :, start:length], cache.v[:, :, start:length])
        else:
            cached = torch.arange(cache.max_len, device=x.device)  # (max_len,)
            visible = cached <= pos if self.window is None else in_window(pos, cached, self.window)
            visible = visible.view(1, -1)  # (1, max_len)
            y = F.scaled_dot_product_attention(q, cache.k, cache.v, attn_mask=visible)  # (B, nh, 1, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.relu2 = config.activation == "relu2"
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU is the tanh approximation
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj.residual_projection = True
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)  # (B, T, 4C)
        h = F.relu(h).square() if self.relu2 else self.gelu(h)  # (B, T, 4C)
        return self.dropout(self.c_proj(h))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig, layer: int) -> None:
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """The block on ``x`` (B, T, C), the tokens ``idx`` (B, T) (read only by a value embedding)."""
        x = x + self.attn(self.ln_1(x), idx)
        return x + self.mlp(self.ln_2(x))

    def forward_cached(
        self, x: torch.Tensor, idx: torch.Tensor, cache: KVCache, pos: torch.Tensor, length: int | None
    ) -> torch.Tensor:
        """``forward`` for generation (no dropout), through ``cache``: see ``CausalSelfAttention.forward_cached``."""
        x = x + self.attn.forward_cached(self.ln_1(x), idx, cache, pos, length)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2: token + position embeddings, ``n_layer`` blocks, final LayerNorm, tied LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        device = torch.empty(0).device  # where the caller builds: the CPU, a torch.device(...) context, or meta
        # Layers made on the meta device (no memory for values GPT-2's init replaces), then memory and
        # init_weights. Built under torch.device("meta"), the model stays empty until to_empty + init_weights.
        with torch.device("meta"):
            layers = dict(wte=nn.Embedding(config.vocab_size, config.n_embd))
            if not config.rotary:  # rotary positions live in the attention: no table
                layers["wpe"] = nn.Embedding(config.block_size, config.n_embd)
            self.transformer = nn.ModuleDict(
                dict(
                    **layers,
                    drop=nn.Dropout(config.dropout),
                    h=nn.ModuleList(Block(config, layer) for layer in range(config.n_layer)),
                    ln_f=make_norm(config),
                )
            )
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            # The residual scalars, registered only when on (GPT-2's keys and draws stay its own).
            if config.residual_scalars:
                self.resid_lambdas = nn.Parameter(torch.empty(config.n_layer))  # (n_layer,)
                self.x0_lambdas = nn.Parameter(torch.empty(config.n_layer))  # (n_layer,)
        self.tie_weights()
        # Recompute each block's activations in the backward pass instead of keeping them: a run setting
        # (the training module sets it), not architecture, so not a GPTConfig field.
        self.activation_checkpointing = False
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights()  # ties the weights again: to_empty gives each module a Parameter of its own

    def tie_weights(self) -> None:
        """Tie the output projection to the token embedding (with ``tie_embeddings``); again after
        ``load_state_dict(assign=True)`` or ``to_empty``, which untie them."""
        if self.config.tie_embeddings:
            self.transformer.wte.weight = self.lm_head.weight

    @classmethod
    def from_state_dict(cls, config: GPTConfig, state: dict[str, torch.Tensor]) -> GPT:
        """A GPT assigned the tensors of ``state`` (``lm_head.weight`` optional), built on the meta device:
        no random init, no copy. Raises RuntimeError if ``state`` does not match ``config``."""
        with torch.device("meta"):
            model = cls(config)
        if config.tie_embeddings:
            state = {"lm_head.weight": state.get("transformer.wte.weight"), **state}
        # assign keeps the state's dtype: cast (only) what is not the model's float32
        expected = model.state_dict()
        state = {k: v.to(expected[k].dtype) if k in expected and v is not None else v for k, v in state.items()}
        model.load_state_dict(state, assign=True)
        model.tie_weights()
        return model

    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """GPT-2's initialization from the CPU ``generator`` (None: the global one), drawn whole on the CPU
        for any placement (GPU, FSDP2 shard), so every placement gets a CPU build's values."""
        self.tie_weights()  # to_empty gave each module a Parameter of its own
        layers = [m for m in self.modules() if isinstance(m, (nn.Linear, nn.Embedding))]
        # First consume the generator as the layers' default inits do, so a seed gives nanoGPT's weights.
        with torch.random.fork_rng(devices=[], enabled=generator is not None):
            if generator is not None:  # the layers draw from the global generator: lend it this state
                torch.random.set_rng_state(generator.get_state())
            for m in layers:
                if isinstance(m, nn.Linear):
                    nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="cpu")
                else:
                    nn.Embedding(m.num_embeddings, m.embedding_dim, device="cpu")
            if generator is not None:
                generator.set_state(torch.random.get_rng_state())
        for m in layers:  # value embeddings too: drawn as the value weights (nanochat)
            if getattr(m, "gate_init", False):  # nanochat: small positive, gates start just above 1.5
                _draw_(m.weight, lambda t: t.uniform_(0.0, 0.02, generator=generator))
                continue
            residual = getattr(m, "residual_projection", False)
            # GPT-2: residual projections scaled by 1/sqrt(number of residual additions)
            std = 0.02 * (2 * self.config.n_layer) ** -0.5 if residual else 0.02
            _draw_(m.weight, lambda t, std=std: t.normal_(0.0, std, generator=generator))
            zeroed = residual or m is self.lm_head  # (an untied head)
            if self.config.zero_init_proj and zeroed and m.weight is not self.transformer.wte.weight:
                nn.init.zeros_(m.weight)  # drawn first all the same: the other weights keep their draws
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
        for m in self.modules():
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                m.reset_parameters()  # gain 1, bias 0: no random numbers
        if self.config.residual_scalars:  # nanochat's starts: 1.15 down to 1.05 and 0.20 down to 0.05 over the layers
            depth = torch.arange(self.config.n_layer, dtype=torch.float32) / max(self.config.n_layer - 1, 1)
            _draw_(self.resid_lambdas, lambda t: t.copy_(1.15 - 0.10 * depth))
            _draw_(self.x0_lambdas, lambda t: t.copy_(0.20 - 0.15 * depth))

    def embed(self, idx: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Token plus position embeddings (B, T, C) of ``idx`` (B, T) at positions ``pos`` (T,); with
        ``rotary`` the token embedding alone (positions enter the attention), RMS-normed with ``rmsnorm``."""
        if self.config.rotary:
            x = self.transformer.wte(idx)  # (B, T, C)
        else:
            x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C) + (T, C)
        return F.rms_norm(x, (x.size(-1),)) if self.config.norm == "rmsnorm" else x

    def num_parameters(self) -> int:
        """Number of parameters, the tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, head_loss: HeadLoss | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(logits, loss)``: logits (B, T, vocab_size) for token ids ``idx`` (B, T), T <= block_size,
        and the mean cross-entropy against next-token ids ``targets`` (B, T) if given (else None).
        ``head_loss`` with targets (training's, ``loss.chunked_cross_entropy``): logits None, the loss by it."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"Sequence length {T} is longer than the model's block_size "
                f"{self.config.block_size}. Use block_size <= {self.config.block_size} in the data, "
                "or build the model with a larger block_size."
            )
        x = self.embed(idx, torch.arange(T, device=idx.device))  # (B, T, C)
        x = self.transformer.drop(x)  # (B, T, C)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()

        def run(i: int, x: torch.Tensor) -> torch.Tensor:
            block = self.transformer.h[i]
            # Checkpointed: only the block's input (B, T, C) is kept; the backward runs it again.
            return checkpoint(block, x, idx, use_reentrant=False) if recompute else block(x, idx)  # (B, T, C)

        return self.head_and_loss(self.trunk(x, run), targets, head_loss)

    def trunk(self, x: torch.Tensor, run: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The blocks on the embedding ``x`` (B, T, C), block ``i`` applied as ``run(i, x)``, with the residual
        and x0 scalars before each block (``residual_scalars``)."""
        x0 = x  # (B, T, C): the blocks' input
        for i in range(self.config.n_layer):
            if self.config.residual_scalars:
                x = self.resid_lambdas[i] * x + self.x0_lambdas[i] * x0  # (B, T, C), nanochat
            x = run(i, x)  # (B, T, C)
        return x

    def head_and_loss(
        self, x: torch.Tensor, targets: torch.Tensor | None = None, head_loss: HeadLoss | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Final norm, LM head and loss: a method of its own, compiled as one region by ``compile_scope: blocks``."""
        B, T, _ = x.shape
        if targets is not None and head_loss is not None:  # training: the loss from the normed states
            h = self.transformer.ln_f(x).view(B * T, -1)  # (B*T, C)
            return None, head_loss(h, self.lm_head.weight, targets.reshape(B * T), self.config.logit_softcap)
        logits = self.logits(x)  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))  # (B*T, V) vs (B*T,)
        return logits, loss

    def logits_at(self, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits (N, vocab_size) at flat ``positions`` (N,) b * T + t into ``idx`` (B, T), the head run only there."""
        B, T = idx.shape
        x = self.embed(idx, torch.arange(T, device=idx.device))  # (B, T, C)
        x = self.trunk(x, lambda i, x: self.transformer.h[i](x, idx))
        x = x.reshape(B * T, -1).index_select(0, positions)  # (N, C)
        return self.logits(x)  # (N, vocab_size)

    def forward_cached(
        self, idx: torch.Tensor, caches: list[KVCache], pos: torch.Tensor, length: int | None = None
    ) -> torch.Tensor:
        """Next-token logits (B, vocab_size) after ``idx`` (B, T) at positions ``pos`` (T,), reading and
        extending one ``KVCache`` per block; the LM head runs on the last position only. A prefill (T > 1)
        starts at 0; a decode step (T == 1) attends to ``length`` cached positions (see the attention's)."""
        x = self.embed(idx, pos)  # (B, T, C)
        blocks = self.transformer.h
        x = self.trunk(x, lambda i, x: blocks[i].forward_cached(x, idx, caches[i], pos, length))  # (B, T, C)
        return self.logits(x[:, -1])  # (B, vocab_size)

    def compute_dtype(self, device_type: str) -> torch.dtype:
        """The dtype the matmuls run in on ``device_type`` now: autocast's where it is on, else the weights'."""
        return compute_dtype(device_type, self.lm_head.weight.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and the tanh ``logit_softcap``, in float32 at least (in bf16, logits near the
        cap round onto it; float64 stays float64): (..., C) -> (..., vocab_size)."""
        logits = self.lm_head(self.transformer.ln_f(x))  # (..., vocab_size)
        if self.config.logit_softcap is not None:
            cap, exact = self.config.logit_softcap, torch.promote_types(logits.dtype, torch.float32)
            logits = cap * torch.tanh(logits.to(exact) / cap)  # (..., vocab_size), float32+, in (-cap, cap)
        return logits
