"""Memory per GPU of a training run, computed: what decides between DDP and FSDP2 for a GPT-2 size.
What is counted and what is not: docs/multi-gpu.md's memory guide."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpt_lightning.config import VALUE_GATE_CHANNELS, GPTConfig
from gpt_lightning.loss import LOSS_CHUNK_ROWS
from gpt_lightning.model import GPT
from gpt_lightning.precision import PRECISIONS

GIB = 2**30


def parameter_count(config: GPTConfig) -> int:
    """Parameters of the GPT (a tied embedding counted once), built on the meta device."""
    with torch.device("meta"):
        return GPT(config).num_parameters()


def value_bytes(precision: str) -> tuple[int, int]:
    """Bytes of a matmul input and of the model's own values (weights, gradients, optimizer states, the residual
    stream, norms) under a Lightning precision (``PRECISIONS``): 2 and 4 under bf16-mixed."""
    if precision not in PRECISIONS:
        raise ValueError(f"no memory estimate for precision {precision!r}: one of {', '.join(PRECISIONS)}")
    return PRECISIONS[precision].matmul.itemsize, PRECISIONS[precision].weights.itemsize


def activation_bytes_per_token(
    config: GPTConfig,
    precision: str = "bf16-mixed",
    activation_checkpointing: bool = False,
    rows: int = 1,
    chunked_loss: bool = True,
    seq_len: int | None = None,
) -> float:
    """Bytes autograd keeps per token of a micro-batch until the backward pass, every switch counted:
    ``rows`` per micro-batch share the per-position tensors, ``seq_len`` (None: block_size) sizes a window's
    mask; with ``activation_checkpointing`` each block keeps its input and one is recomputed at a time."""
    C, V = config.n_embd, config.vocab_size
    a, e = value_bytes(precision)
    f = max(e, 4)  # what is float32 at least: the softcapped logits, RMSNorm (CPU: a half input upcast)
    # ids (int64), and the targets F.cross_entropy keeps (the chunked loss does not); positions, one per position
    ids = 8 + (0 if chunked_loss else 8) + (0 if config.rotary else 8 / rows)
    embedding = f * C + f if config.norm == "rmsnorm" else 0  # the embedding's RMSNorm (no gain): input, rstd
    # the log-softmax (softcapped: and the tanh, float32 at least); in the model's dtype, as CPU autocast upcasts
    logits = 0 if chunked_loss else 2 * f * V if config.logit_softcap is not None else e * V
    head = ids + embedding + norm_bytes_per_token(config, precision) + a * C + logits
    if config.residual_scalars:  # each block's incoming stream that resid_lambdas[i] multiplies (x0 too)
        head += config.n_layer * e * C
    blocks = [
        block_activation_bytes_per_token(config, precision, layer, rows, seq_len) for layer in range(config.n_layer)
    ]
    if activation_checkpointing:
        return config.n_layer * e * C + max(blocks) + head  # the blocks' inputs, and one block recomputed
    return sum(blocks) + head


def norm_bytes_per_token(config: GPTConfig, precision: str = "bf16-mixed") -> int:
    """Bytes one norm keeps per token: its input and statistics (LayerNorm: mean and rstd; RMSNorm: rstd,
    and the normed input where a gain multiplies it), float32 under autocast; under a true precision
    the dtype's, except that the CPU's RMSNorm works on a half input in float32 and keeps that."""
    C = config.n_embd
    e = value_bytes(precision)[1]
    if config.norm == "layernorm":
        return e * C + 2 * e
    f = max(e, 4)
    return f * C + f + (f * C if config.norm_affine else 0)


def block_activation_bytes_per_token(
    config: GPTConfig,
    precision: str = "bf16-mixed",
    layer: int | None = None,
    rows: int = 1,
    seq_len: int | None = None,
) -> float:
    """Bytes ``Block`` number ``layer`` (None: the largest) keeps per token, counted from the tensors its
    backward reads; the arguments as in ``activation_bytes_per_token``."""
    if layer is None:
        return max(block_activation_bytes_per_token(config, precision, i, rows, seq_len) for i in range(config.n_layer))
    C, nh = config.n_embd, config.n_head
    a, e = value_bytes(precision)
    hs, f = C // nh, max(e, 4)
    value_embedding = config.has_value_embedding(layer)
    attention = a * C + a * C + f * nh  # c_attn's input; SDPA's output and log-sum-exp (float32 at least)
    if config.rotary or config.qk_norm:  # q and k new tensors: SDPA's inputs, and its output is copied for c_proj
        attention += 3 * a * C
    if config.rotary:
        attention += 2 * a * hs / rows  # cos and sin, (T, hs/2), for q and for k
    if config.qk_norm:  # an rstd per head, and the input in float32: an upcast copy of a half one
        attention += 2 * f * nh + (2 * f * C if a < 4 or config.rotary else 0)  # (else views of qkv)
    if value_embedding:  # the table's rows and the gated values; the gate's sigmoid, scaled, and bf16 input
        attention += 2 * a * C + 2 * a * nh + (2 * VALUE_GATE_CHANNELS if a < e else 0)
    if config.attention_window(layer) is not None:  # SDPA's additive (T, T) band mask, shared by the rows
        attention += a * (seq_len or config.block_size) / rows  # (flex attention's, compiled on CUDA: a few bytes)
    if not value_embedding or not config.rotary and not (config.qk_norm and a < 4):
        attention += 3 * a * C  # c_attn's output, while SDPA or a float32 rms_norm reads a view of it
    mlp = a * C + 2 * 4 * a * C  # c_fc's input; the activation's input and output
    return 2 * norm_bytes_per_token(config, precision) + attention + mlp


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes per GPU, by what holds them."""

    weights_grads_optimizer: float  # weights, gradients, optimizer states: 16 B a parameter, float32 AdamW
    ddp_buckets: float  # DDP's gradient buckets: a gradient's bytes a parameter, with several processes
    bf16_weight_copies: float  # autocast's bf16 copies of the weights, kept for the backward: 2 B a parameter
    activations: float  # what autograd keeps, and the loss's peak beyond it (``loss_peak_bytes``)
    tokens: int  # per micro-batch, per device
    weight_average: float = 0.0  # EMAWeightAveraging's copy of the module: a weight's bytes a parameter

    @property
    def total(self) -> float:
        return (
            self.weights_grads_optimizer
            + self.ddp_buckets
            + self.bf16_weight_copies
            + self.activations
            + self.weight_average
        )


def loss_peak_bytes(config: GPTConfig, tokens: int, precision: str = "bf16-mixed", chunked_loss: bool = True) -> float:
    """Bytes the loss holds at its peak beyond what autograd keeps, on CUDA: ``F.cross_entropy``'s
    gradients over all ``tokens``' logits, or one chunk's logits and the head's float32 weight gradient."""
    V, capped = config.vocab_size, config.logit_softcap is not None
    a, e = value_bytes(precision)
    f = max(e, 4)
    if not chunked_loss:
        return tokens * V * (2 * f if capped else e + a)
    return min(tokens, LOSS_CHUNK_ROWS) * V * (3 * f if capped else a + f) + f * V * config.n_embd


def training_memory(
    config: GPTConfig,
    micro_batch_size: int,
    seq_len: int | None = None,
    shards: int = 1,
    precision: str = "bf16-mixed",
    activation_checkpointing: bool = False,
    ddp: bool = True,
    chunked_loss: bool = True,
    weight_average: bool = False,
    states_per_parameter: float = 2.0,
) -> TrainingMemory:
    """Memory per GPU of one training step of ``micro_batch_size`` rows of ``seq_len`` (None: block_size)
    tokens: ``shards`` is 1 for DDP (with gradient buckets if ``ddp``), else the GPUs FSDP2 shards over;
    ``weight_average``: an averaging callback's copy on this device; ``states_per_parameter``: AdamW's 2."""
    n = parameter_count(config)
    tokens = micro_batch_size * (seq_len or config.block_size)
    unsharded = shards == 1  # FSDP2 has no buckets and gathers one block's weights at a time
    a, e = value_bytes(precision)
    per_token = activation_bytes_per_token(
        config, precision, activation_checkpointing, micro_batch_size, chunked_loss, seq_len
    )
    return TrainingMemory(
        weights_grads_optimizer=e * (2 + states_per_parameter) * n / shards,
        ddp_buckets=e * n if unsharded and ddp else 0.0,
        bf16_weight_copies=a * n if unsharded and a < e else 0.0,
        activations=tokens * per_token + loss_peak_bytes(config, tokens, precision, chunked_loss),
        tokens=tokens,
        weight_average=e * n if weight_average else 0.0,
    )


def fit_warning(estimate: TrainingMemory, capacity: float, device_name: str) -> str | None:
    """A warning when a run's estimate exceeds the device's memory, saying what would fit it."""
    if estimate.total <= 0.95 * capacity:
        return None
    return (
        f"Estimated {estimate.total / GIB:.1f} GiB per device but the {device_name} has {capacity / GIB:.1f} GiB: "
        "this run will likely run out of memory. Lower --data.batch_size (keep the batch with "
        "--data.tokens_per_step), add --model.activation_checkpointing true, or shard with "
        "--config configs/fsdp2.yaml."
    )


# The GPT-2 family at T = 1024 with its published shapes, as configs/gpt2*.yaml define it.
GPT2_FAMILY = {
    "124M": GPTConfig(),
    "350M": GPTConfig(n_layer=24, n_head=16, n_embd=1024),
    "774M": GPTConfig(n_layer=36, n_head=20, n_embd=1280),
    "1558M": GPTConfig(n_layer=48, n_head=25, n_embd=1600),
}


def guide_table(micro_batch_size: int = 16, gpus: int = 8) -> str:
    """The memory guide's table (docs/multi-gpu.md): GiB per GPU at ``micro_batch_size`` rows of 1024 tokens, bf16-mixed."""
    rows = [
        f"| model | parameters | states, DDP | states, FSDP2 over {gpus} | activations and loss | activations and loss, "
        f"checkpointed | total, DDP | total, FSDP2 | total, FSDP2 checkpointed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, config in GPT2_FAMILY.items():
        ddp = training_memory(config, micro_batch_size)
        fsdp = training_memory(config, micro_batch_size, shards=gpus)
        checkpointed = training_memory(config, micro_batch_size, shards=gpus, activation_checkpointing=True)
        cells = [
            ddp.weights_grads_optimizer + ddp.ddp_buckets + ddp.bf16_weight_copies,
            fsdp.weights_grads_optimizer,
            ddp.activations,
            checkpointed.activations,
            ddp.total,
            fsdp.total,
            checkpointed.total,
        ]
        rows.append(f"| {name} | {parameter_count(config):,} | " + " | ".join(f"{c / GIB:.1f}" for c in cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(guide_table())
