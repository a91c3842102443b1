"""The memory guide's arithmetic against what PyTorch really holds, and the docs' table against it."""

import math

import pytest
import torch
import yaml
from conftest import REPO
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import gpt_lightning.loss
import gpt_lightning.scaling.memory
from gpt_lightning.loss import chunked_cross_entropy
from gpt_lightning.model import GPT, MODERN_SWITCHES, GPTConfig
from gpt_lightning.scaling.memory import (
    GPT2_FAMILY,
    activation_bytes_per_token,
    block_activation_bytes_per_token,
    guide_table,
    parameter_count,
    training_memory,
)


def kept_for_backward(model: GPT, x: torch.Tensor, mixed: bool = False, chunked: bool = False) -> int:
    """Bytes of the distinct storages autograd saves during a forward (``mixed``: under bf16
    autocast; ``chunked``: the training loss), parameters and autocast's bf16 copies of them (counted apart) excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        node = t.grad_fn  # a weight copy: a parameter's cast (ToCopy), maybe transposed
        while type(node).__name__ in ("TBackward0", "ToCopyBackward0"):
            node = node.next_functions[0][0]
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and type(node).__name__ != "AccumulateGrad":
            kept[storage.data_ptr()] = storage.nbytes()  # views of one storage count once
        return t

    targets = torch.roll(x, -1, dims=1)  # a tensor of their own, as a training batch's
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", torch.bfloat16, enabled=mixed),
    ):
        model(x, targets, head_loss=chunked_cross_entropy if chunked else None)
    return sum(kept.values())


@pytest.mark.parametrize(
    "n_layer, n_head, n_embd, vocab_size, bias", [(1, 4, 64, 256, True), (3, 2, 32, 512, True), (2, 3, 48, 300, False)]
)
def test_activation_count_is_what_autograd_keeps_in_float32(n_layer, n_head, n_embd, vocab_size, bias):
    config = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size, block_size=32, bias=bias)
    torch.manual_seed(0)
    model = GPT(config)
    x = torch.randint(0, vocab_size, (2, 32))
    tokens = x.numel()
    estimate = tokens * activation_bytes_per_token(config, mixed=False, rows=2, chunked_loss=False)
    assert kept_for_backward(model, x) == pytest.approx(estimate, abs=16)
    # Checkpointed, the forward keeps the blocks' inputs; one block's activations come back in the backward.
    model.activation_checkpointing = True
    checkpointed = activation_bytes_per_token(
        config, mixed=False, activation_checkpointing=True, rows=2, chunked_loss=False
    )
    assert kept_for_backward(model, x) == pytest.approx(
        tokens * (checkpointed - block_activation_bytes_per_token(config, mixed=False, rows=2)), abs=16
    )


def preset_switches(name: str) -> dict:
    """The architecture switches a shipped preset sets (biases off among them)."""
    model = yaml.safe_load((REPO / "configs" / name).read_text())["model"]
    return {key: model[key] for key in (*MODERN_SWITCHES, "bias") if key in model}


MODERN = preset_switches("modern-124m-fineweb.yaml")


@pytest.mark.parametrize(
    "switches",
    [
        {},
        *({key: value} for key, value in MODERN.items()),
        MODERN,
        {"residual_scalars": True},  # between the blocks; in no preset
        {**MODERN, "residual_scalars": True},
        {"window_pattern": "SSL"},  # (windows: not in MODERN)
    ],
    ids=lambda switches: (
        ",".join(switches) if len(switches) < 2 else "all+scalars" if "residual_scalars" in switches else "all"
    ),
)
def test_activation_count_of_each_switch_is_what_autograd_keeps_under_bf16_autocast(switches):
    """Each switch of the modern preset alone (RMSNorm alone has gains) and all of them, as
    bf16-mixed keeps them and in float32, checkpointed too (with value embeddings the largest block
    is the one recomputed). Counted on the CPU; CUDA's fused kernels (RMSNorm's) may keep less."""
    config = GPTConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=512, block_size=32, **switches)
    torch.manual_seed(0)
    model = GPT(config)
    x = torch.randint(0, 512, (2, 32))
    for mixed in (True, False):
        estimate = x.numel() * activation_bytes_per_token(config, mixed=mixed, rows=2, chunked_loss=False, seq_len=32)
        assert kept_for_backward(model, x, mixed) == pytest.approx(estimate, abs=16), mixed
        # The chunked training loss keeps no logits: the head input's gradient, and its weight's (float32).
        estimate = x.numel() * activation_bytes_per_token(config, mixed=mixed, rows=2, seq_len=32) + 4 * 512 * 32
        assert kept_for_backward(model, x, mixed, chunked=True) == pytest.approx(estimate, abs=16), mixed
    model.activation_checkpointing = True
    checkpointed = activation_bytes_per_token(
        config, activation_checkpointing=True, rows=2, chunked_loss=False, seq_len=32
    ) - block_activation_bytes_per_token(config, rows=2)  # the recomputed block: in the backward
    assert kept_for_backward(model, x, mixed=True) == pytest.approx(x.numel() * checkpointed, abs=16)


class LivePeak(TorchDispatchMode):
    """The peak of the bytes held by the storages the ops make while it is on (parameters excluded)."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}  # (views of them are made)
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.live = {key: held for key, held in self.live.items() if not held[0].expired()}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.live.keys() | self.params:
                self.live[t.untyped_storage().data_ptr()] = (
                    StorageWeakRef(t.untyped_storage()),
                    t.untyped_storage().nbytes(),
                )
        self.peak = max(self.peak, sum(nbytes for _, nbytes in self.live.values()))
        return out


@pytest.mark.parametrize(
    "switches", [{}, {"logit_softcap": 15.0, "tie_embeddings": False}], ids=["gpt2", "softcap,untied"]
)
@pytest.mark.parametrize("chunked", [False, True], ids=["cross_entropy", "chunked"])
def test_the_loss_peak_is_what_a_step_holds_beyond_what_autograd_keeps(switches, chunked, monkeypatch):
    """The peak of a forward and backward, the vocabulary-wide tensors of the loss included (the
    guide counted only the float32 log-softmax: 30% low on an H200). In float32, as on CUDA; CPU
    autocast upcasts bf16 logits before the log-softmax where CUDA's takes them as they are, which
    costs the CPU 2 bytes a logit (F.cross_entropy's backward), 4 a chunk's logit (chunked)."""
    for module in (gpt_lightning.loss, gpt_lightning.scaling.memory):
        monkeypatch.setattr(module, "LOSS_CHUNK_ROWS", 256)  # 4 chunks
    B, T, V = 8, 128, 8192
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=V, block_size=T, **switches)
    for mixed in (False, True):
        torch.manual_seed(0)
        model = GPT(config)
        x = torch.randint(0, V, (B, T))
        with LivePeak(model) as held:
            with torch.autocast("cpu", torch.bfloat16, enabled=mixed):
                loss = model(x, torch.roll(x, -1, dims=1), head_loss=chunked_cross_entropy if chunked else None)[1]
            loss.backward()
        estimate = training_memory(config, B, T, mixed=mixed, chunked_loss=chunked).activations
        cpu_upcast = 0 if "logit_softcap" in switches or not mixed else (4 * 256 if chunked else 2 * B * T) * V
        assert held.peak == pytest.approx(estimate + cpu_upcast, rel=0.04), mixed  # the blocks' CPU temporaries: < 1 MB
    unchunked = training_memory(config, B, T, chunked_loss=False).activations
    assert unchunked > 2 * training_memory(config, B, T).activations  # what the chunks save


def test_weights_gradients_and_adamw_take_16_bytes_a_parameter():
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=300, block_size=16)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 300, (2, 16))
    model(x, x)[1].backward()
    optimizer.step()
    held = sum(p.nbytes + p.grad.nbytes for p in model.parameters())
    held += sum(s[k].nbytes for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))
    assert held == training_memory(config, 1, shards=1, mixed=False).weights_grads_adamw == 16 * parameter_count(config)
    assert training_memory(config, 1, shards=8).weights_grads_adamw == held / 8


def test_the_family_is_the_shipped_configs_and_counts_its_parameters():
    for name, config in zip(("124m", "medium", "large", "xl"), GPT2_FAMILY.values()):
        shipped = yaml.safe_load((REPO / f"configs/gpt2-{name}.yaml").read_text())["model"]
        for field in ("n_layer", "n_head", "n_embd"):
            assert shipped.get(field, getattr(GPTConfig(), field)) == getattr(config, field), (name, field)
        with torch.device("meta"):
            assert parameter_count(config) == GPT(config).num_parameters()
    # The modern switches: no position table, no biases or norm gains, an untied head of its own.
    C, L, V = 768, 12, 50304
    modern = GPTConfig(vocab_size=V, rotary=True, bias=False, norm="rmsnorm", norm_affine=False, tie_embeddings=False)
    assert parameter_count(modern) == 2 * V * C + L * 12 * C * C  # was counted as GPT-2's, 30% short
    # Value embeddings: a table and a 12-channel gate per head in every other block (6 of 12).
    with_tables = GPTConfig(**{**modern.__dict__, "value_embeddings": True})
    assert parameter_count(with_tables) - parameter_count(modern) == 6 * (V * C + 12 * 12)


def test_the_docs_table_is_the_computed_one():
    from test_readme import DOCS_TEXT

    assert guide_table() in DOCS_TEXT  # the strategy guide, docs/multi-gpu.md


class FakeMesh:
    """The DeviceMesh API sharding_mesh uses, without a process group."""

    def __init__(self, *sizes: int, names: tuple[str, ...] = ("data_parallel", "tensor_parallel")) -> None:
        self.sizes, self.mesh_dim_names, self.ndim = sizes, names, len(sizes)

    def __getitem__(self, name: str) -> "FakeMesh":
        return FakeMesh(self.sizes[self.mesh_dim_names.index(name)], names=(name,))

    def size(self, dim: int | None = None) -> int:
        return self.sizes[dim] if dim is not None else math.prod(self.sizes)


def test_a_run_s_estimate_follows_its_strategy_and_warns_when_it_cannot_fit():
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from gpt_lightning.observing.console import run_memory
    from gpt_lightning.scaling.memory import GIB, fit_warning

    xl = GPT2_FAMILY["1558M"]
    # ModelParallelStrategy's (data_parallel, tensor_parallel) mesh: 1 node x 8 GPUs, its default.
    module = SimpleNamespace(
        config=xl, model=SimpleNamespace(activation_checkpointing=True), device_mesh=FakeMesh(1, 8)
    )
    data = SimpleNamespace(batch_size=16, block_size=1024)
    fsdp = SimpleNamespace(strategy=ModelParallelStrategy(), world_size=8, precision="bf16-mixed", datamodule=data)
    estimate = run_memory(fsdp, module)
    assert estimate == training_memory(xl, 16, 1024, shards=8, activation_checkpointing=True)
    assert f"| {estimate.total / GIB:.1f} |" in guide_table().splitlines()[-1]  # the guide's last column
    # 2 nodes x 8 GPUs: HSDP shards over the 8 GPUs of a node, not over all 16.
    module.device_mesh, fsdp.world_size = FakeMesh(2, 8), 16
    assert run_memory(fsdp, module).weights_grads_adamw == 16 * parameter_count(xl) / 8
    module.device_mesh, fsdp.world_size = FakeMesh(8, 1), 8  # data_parallel_size 8 set by hand: all 8 shard
    assert run_memory(fsdp, module).weights_grads_adamw == 16 * parameter_count(xl) / 8
    ddp = SimpleNamespace(strategy=DDPStrategy(), world_size=8, precision="bf16-mixed", datamodule=data)
    module.model.activation_checkpointing = False
    assert run_memory(ddp, module) == training_memory(xl, 16, 1024)  # buckets and bf16 copies counted
    assert run_memory(ddp, module).ddp_buckets + run_memory(ddp, module).bf16_weight_copies == 6 * parameter_count(xl)

    too_big = fit_warning(run_memory(ddp, module), 80e9, "NVIDIA H100 80GB HBM3")  # 80 GB: 74.5 GiB
    assert too_big.startswith("Estimated 75.2 GiB per device but the NVIDIA H100 80GB HBM3 has 74.5 GiB")
    assert "--config configs/fsdp2.yaml" in too_big
    assert fit_warning(run_memory(fsdp, module), 80 * GIB, "H100") is None
