"""Memory per GPU of a training run, computed: what decides between DDP and FSDP2 for a GPT-2 size.

Every byte counted here is named: float32 weights, gradients and AdamW's two moments (16 bytes a
parameter), DDP's gradient buckets and autocast's bfloat16 weight copies, and the activations
autograd keeps for the backward pass. The activation count follows the tensors this package's
``Block`` saves in eager mode (SDPA attention keeps q, k, v, its output and a log-sum-exp, never the
T x T matrix); in float32 it equals what autograd really keeps, byte for byte up to a few bytes a
token (tests/test_memory.py measures it). ``torch.compile`` fuses GELU and the loss and keeps less,
so the figures are an upper bound for compiled runs. CUDA's allocator, NCCL buffers and the
backward's transient tensors (about 6 x vocab_size bytes a token at the LM head) come on top.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpt_lightning.model import GPT, VALUE_GATE_CHANNELS, GPTConfig

GIB = 2**30


def parameter_count(config: GPTConfig) -> int:
    """Parameters of the GPT, the tied embedding counted once, without building it (the modern
    switches' too: no position table with rotary, an untied head, the norms' gains, value embeddings)."""
    C, L, V, T = config.n_embd, config.n_layer, config.vocab_size, config.block_size
    bias = int(config.bias)
    norm = 0 if not config.norm_affine else C if config.norm == "rmsnorm" else (1 + bias) * C  # gain (and bias)
    per_block = 12 * C * C + bias * 9 * C + 2 * norm  # 4 matmuls + their biases, 2 norms
    embeddings = V * C + (0 if config.rotary else T * C) + (0 if config.tie_embeddings else V * C)  # wte, wpe, head
    value_embeddings = sum(V * C + VALUE_GATE_CHANNELS * config.n_head for layer in range(L)
                           if config.has_value_embedding(layer))  # a table and a gate each
    return embeddings + L * per_block + value_embeddings + norm  # ..., final norm


def activation_bytes_per_token(config: GPTConfig, mixed: bool = True, activation_checkpointing: bool = False) -> int:
    """Bytes autograd keeps per token of a micro-batch until the backward pass.

    Args:
        config: the architecture.
        mixed: ``bf16-mixed`` (matmul inputs kept as bfloat16 copies; LayerNorms and the loss in
            float32) rather than ``32-true``.
        activation_checkpointing: each block keeps only its float32 input; one block's activations
            exist at a time while it is recomputed.
    """
    C, V = config.n_embd, config.vocab_size
    head = (6 if mixed else 8) * C + 4 * V + 20  # final LayerNorm, LM-head input, float32 log-softmax, ids
    layer = block_activation_bytes_per_token(config, mixed)
    if activation_checkpointing:
        return config.n_layer * 4 * C + layer + head  # the blocks' inputs, and one block recomputed
    return config.n_layer * layer + head


def block_activation_bytes_per_token(config: GPTConfig, mixed: bool = True) -> int:
    """Bytes one ``Block`` keeps per token. float32: LayerNorm inputs 2 x 4C, q/k/v 12C, attention
    output 4C and its contiguous copy 4C, LayerNorm outputs (the matmuls' inputs) 2 x 4C, GELU input
    and output 2 x 16C; plus a log-sum-exp per head and LayerNorm means and rstds. bf16-mixed keeps
    every matmul input and the attention tensors as 2-byte copies; LayerNorm inputs stay float32."""
    return (38 if mixed else 64) * config.n_embd + 4 * config.n_head + 16


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes per GPU, by what holds them."""

    weights_grads_adamw: float  # float32 weights, gradients, AdamW exp_avg and exp_avg_sq: 16 B a parameter
    ddp_buckets: float  # DDP's gradient buckets: 4 B a parameter, with several processes
    bf16_weight_copies: float  # autocast's bf16 copies of the weights, kept for the backward: 2 B a parameter
    activations: float
    tokens: int  # per micro-batch, per device

    @property
    def total(self) -> float:
        return self.weights_grads_adamw + self.ddp_buckets + self.bf16_weight_copies + self.activations


def training_memory(
    config: GPTConfig,
    micro_batch_size: int,
    seq_len: int | None = None,
    shards: int = 1,
    mixed: bool = True,
    activation_checkpointing: bool = False,
    ddp: bool = True,
) -> TrainingMemory:
    """Memory per GPU of one training step.

    Args:
        config: the architecture.
        micro_batch_size: rows per GPU per forward (``data.batch_size``).
        seq_len: tokens per row; the model's block_size if None.
        shards: 1 for DDP (every GPU holds everything); the number of GPUs FSDP2 shards over.
        mixed: bf16-mixed rather than 32-true.
        activation_checkpointing: see ``activation_bytes_per_token``.
        ddp: with ``shards`` 1, whether DDP keeps gradient buckets (several processes) or not (one).
    """
    n = parameter_count(config)
    tokens = micro_batch_size * (seq_len or config.block_size)
    unsharded = shards == 1  # FSDP2 has no buckets and gathers one block's weights at a time
    return TrainingMemory(
        weights_grads_adamw=16 * n / shards,
        ddp_buckets=4 * n if unsharded and ddp else 0.0,
        bf16_weight_copies=2 * n if unsharded and mixed else 0.0,
        activations=tokens * activation_bytes_per_token(config, mixed, activation_checkpointing),
        tokens=tokens,
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
        f"| model | parameters | states, DDP | states, FSDP2 over {gpus} | activations | activations, "
        f"checkpointed | total, DDP | total, FSDP2 | total, FSDP2 checkpointed |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, config in GPT2_FAMILY.items():
        ddp = training_memory(config, micro_batch_size)
        fsdp = training_memory(config, micro_batch_size, shards=gpus)
        checkpointed = training_memory(config, micro_batch_size, shards=gpus, activation_checkpointing=True)
        cells = [
            ddp.weights_grads_adamw + ddp.ddp_buckets + ddp.bf16_weight_copies,
            fsdp.weights_grads_adamw,
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
