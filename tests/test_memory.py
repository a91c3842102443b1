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
from gpt_lightning.config import MODERN_SWITCHES, GPTConfig
from gpt_lightning.loss import chunked_cross_entropy
from gpt_lightning.model import GPT
from gpt_lightning.scaling.memory import (
    GPT2_FAMILY,
    activation_bytes_per_token,
    block_activation_bytes_per_token,
    guide_table,
    parameter_count,
    training_memory,
)

# Each precision as Lightning runs it: (autocast's dtype, or None; the dtype the whole module is cast to).
PRECISIONS = {
    "bf16-mixed": (torch.bfloat16, torch.float32),
    "32-true": (None, torch.float32),
    "bf16-true": (None, torch.bfloat16),
    "64-true": (None, torch.float64),
}


def kept_for_backward(model: GPT, x: torch.Tensor, precision: str = "32-true", chunked: bool = False) -> int:
    """Bytes of the distinct storages autograd saves during a forward under ``precision`` (``PRECISIONS``;
    ``chunked``: the training loss), parameters and autocast's bf16 copies of them (counted apart) excluded."""
    autocast, dtype = PRECISIONS[precision]
    model.to(dtype)
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
        torch.autocast("cpu", autocast or torch.bfloat16, enabled=autocast is not None),
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
    estimate = tokens * activation_bytes_per_token(config, "32-true", rows=2, chunked_loss=False)
    assert kept_for_backward(model, x) == pytest.approx(estimate, abs=16)
    # Checkpointed, the forward keeps the blocks' inputs; one block's activations come back in the backward.
    model.activation_checkpointing = True
    checkpointed = activation_bytes_per_token(
        config, "32-true", activation_checkpointing=True, rows=2, chunked_loss=False
    )
    assert kept_for_backward(model, x) == pytest.approx(
        tokens * (checkpointed - block_activation_bytes_per_token(config, "32-true", rows=2)), abs=16
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
def test_activation_count_of_each_switch_is_what_autograd_keeps_at_each_precision(switches):
    """Each switch of the modern preset alone (RMSNorm alone has gains) and all of them, as each
    precision keeps them (bf16-true: half of 32-true's but for what stays float32), checkpointed too
    (with value embeddings the largest block is the one recomputed). Counted on the CPU; CUDA's fused
    kernels (RMSNorm's) may keep less."""
    config = GPTConfig(n_layer=3, n_head=2, n_embd=32, vocab_size=512, block_size=32, **switches)
    torch.manual_seed(0)
    model = GPT(config)
    x = torch.randint(0, 512, (2, 32))
    for precision in PRECISIONS:
        estimate = x.numel() * activation_bytes_per_token(config, precision, rows=2, chunked_loss=False, seq_len=32)
        assert kept_for_backward(model, x, precision) == pytest.approx(estimate, abs=16), precision
        # The chunked training loss keeps no logits: the head input's gradient, and its weight's (float32+).
        head_grad = max(4, PRECISIONS[precision][1].itemsize) * 512 * 32
        estimate = x.numel() * activation_bytes_per_token(config, precision, rows=2, seq_len=32) + head_grad
        assert kept_for_backward(model, x, precision, chunked=True) == pytest.approx(estimate, abs=16), precision
    model.activation_checkpointing = True
    checkpointed = activation_bytes_per_token(
        config, activation_checkpointing=True, rows=2, chunked_loss=False, seq_len=32
    ) - block_activation_bytes_per_token(config, rows=2)  # the recomputed block: in the backward
    assert kept_for_backward(model, x, "bf16-mixed") == pytest.approx(x.numel() * checkpointed, abs=16)


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
    guide counted only the float32 log-softmax: 30% low on an H200), at each precision. The CPU's
    log-softmax upcasts bf16 logits to float32 first where CUDA's takes them as they are, which costs
    the CPU 2 bytes a logit (autocast's F.cross_entropy backward), 4 a chunk's logit (chunked)."""
    for module in (gpt_lightning.loss, gpt_lightning.scaling.memory):
        monkeypatch.setattr(module, "LOSS_CHUNK_ROWS", 256)  # 4 chunks
    B, T, V = 8, 128, 8192
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=V, block_size=T, **switches)
    for precision, (autocast, dtype) in PRECISIONS.items():
        torch.manual_seed(0)
        model = GPT(config).to(dtype)
        x = torch.randint(0, V, (B, T))
        with LivePeak(model) as held:
            with torch.autocast("cpu", autocast or torch.bfloat16, enabled=autocast is not None):
                loss = model(x, torch.roll(x, -1, dims=1), head_loss=chunked_cross_entropy if chunked else None)[1]
            loss.backward()
        estimate = training_memory(config, B, T, precision=precision, chunked_loss=chunked).activations
        # the CPU's log-softmax upcasts half logits (the chunk's, or autocast's F.cross_entropy's) to float32 first
        half = (autocast or dtype) == torch.bfloat16
        upcast = (4 * 256 if chunked else 2 * B * T * (autocast is not None)) * V * half
        cpu_upcast = 0 if "logit_softcap" in switches else upcast
        assert held.peak == pytest.approx(estimate + cpu_upcast, rel=0.04), precision  # CPU temporaries: < 1 MB
    unchunked = training_memory(config, B, T, chunked_loss=False).activations
    assert unchunked > 2 * training_memory(config, B, T).activations  # what the chunks save


def test_muon_keeps_one_state_for_the_blocks_matrices_and_adamw_s_two_for_the_rest():
    """The optimizer states a Muon run holds after a step equal the estimate's: a momentum for each block
    matrix, two moments for embeddings, head, norms and biases (the estimate counted AdamW's for all); so do
    those of an --optimizer of the user's (SGD with and without momentum, Adam with amsgrad)."""
    from types import SimpleNamespace

    from gpt_lightning.observing.console import optimizer_states_per_parameter
    from gpt_lightning.training.optimizers import build_optimizer

    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=300, block_size=16)
    model = GPT(config)
    muon = dict(muon_learning_rate=0.02, muon_momentum=0.95, muon_weight_decay=0.0, muon_adjust_lr="original")
    hparams = dict(optimizer="muon", learning_rate=1e-3, weight_decay=0.0, betas=(0.9, 0.95), eps=1e-8, **muon)
    optimizer = build_optimizer(model, hparams, fused=None)
    x = torch.randint(0, 300, (2, 16))
    model(x, x)[1].backward()
    optimizer.step()
    held = sum(p.nbytes + p.grad.nbytes for p in model.parameters())
    held += sum(
        t.nbytes for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t) and t.dim()
    )
    states = optimizer_states_per_parameter(SimpleNamespace(optimizers=[optimizer]))  # as a run's estimate counts
    assert held == training_memory(config, 1, precision="32-true", states_per_parameter=states).weights_grads_optimizer
    assert held < training_memory(config, 1, precision="32-true").weights_grads_optimizer  # AdamW's: 16 B each
    for make in (
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        lambda p: torch.optim.SGD(p, lr=0.1),
        lambda p: torch.optim.Adam(p, amsgrad=True),
    ):
        optimizer = make(model.parameters())
        optimizer.step()
        held = sum(p.nbytes + p.grad.nbytes for p in model.parameters())
        held += sum(t.nbytes for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim())
        states = optimizer_states_per_parameter(SimpleNamespace(optimizers=[optimizer]))
        estimate = training_memory(config, 1, precision="32-true", states_per_parameter=states)
        assert held == estimate.weights_grads_optimizer, optimizer


@pytest.mark.parametrize("precision, per_parameter", [("32-true", 16), ("bf16-true", 8), ("64-true", 32)])
def test_weights_gradients_and_adamw_take_four_values_a_parameter(precision, per_parameter):
    """In the module's dtype: float32 under the mixed precisions (their bf16 copies counted apart)."""
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=300, block_size=16)
    model = GPT(config).to(PRECISIONS[precision][1])
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 300, (2, 16))
    model(x, x)[1].backward()
    optimizer.step()
    held = sum(p.nbytes + p.grad.nbytes for p in model.parameters())
    held += sum(s[k].nbytes for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq"))
    estimate = training_memory(config, 1, shards=1, precision=precision)
    assert held == estimate.weights_grads_optimizer == per_parameter * parameter_count(config)
    assert training_memory(config, 1, shards=8, precision=precision).weights_grads_optimizer == held / 8
    assert estimate.bf16_weight_copies == 0  # autocast's, under the mixed precisions only
    assert training_memory(config, 1, precision="bf16-mixed").bf16_weight_copies == 2 * parameter_count(config)


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
    assert run_memory(fsdp, module).weights_grads_optimizer == 16 * parameter_count(xl) / 8
    module.device_mesh, fsdp.world_size = FakeMesh(8, 1), 8  # data_parallel_size 8 set by hand: all 8 shard
    assert run_memory(fsdp, module).weights_grads_optimizer == 16 * parameter_count(xl) / 8
    ddp = SimpleNamespace(strategy=DDPStrategy(), world_size=8, precision="bf16-mixed", datamodule=data)
    module.model.activation_checkpointing = False
    assert run_memory(ddp, module) == training_memory(xl, 16, 1024)  # buckets and bf16 copies counted
    assert run_memory(ddp, module).ddp_buckets + run_memory(ddp, module).bf16_weight_copies == 6 * parameter_count(xl)

    ddp.precision = "bf16-true"  # bf16 states, no weight copies: it fits where bf16-mixed does not
    assert run_memory(ddp, module) == training_memory(xl, 16, 1024, precision="bf16-true")
    assert fit_warning(run_memory(ddp, module), 80e9, "NVIDIA H100 80GB HBM3") is None
    ddp.precision = "transformer-engine"  # no estimate rather than a wrong one
    assert run_memory(ddp, module) is None
    ddp.precision = "bf16-mixed"
    too_big = fit_warning(run_memory(ddp, module), 80e9, "NVIDIA H100 80GB HBM3")  # 80 GB: 74.5 GiB
    assert too_big.startswith("Estimated 75.2 GiB per device but the NVIDIA H100 80GB HBM3 has 74.5 GiB")
    assert "--config configs/fsdp2.yaml" in too_big
    assert fit_warning(run_memory(fsdp, module), 80 * GIB, "H100") is None


def test_without_gradients_the_loss_holds_one_chunk_at_a_time():
    """Validation's loss (no grad mode) frees each chunk's log-softmax before it makes the next chunk's:
    one chunk's float32 logits and log-softmax at the peak, not two chunks' log-softmax (it kept the last)."""
    torch.manual_seed(0)
    N, C, V, rows = 1024, 32, 8192, 256
    head = torch.nn.Linear(C, V, bias=False)  # its weight: a parameter, not counted
    h, targets = torch.randn(N, C), torch.randint(0, V, (N,))
    with torch.no_grad(), LivePeak(head) as held:
        chunked_cross_entropy(h, head.weight, targets, chunk_rows=rows)
    one_chunk = rows * V * (4 + 4)  # its logits and log-softmax, float32
    assert one_chunk <= held.peak <= 1.1 * one_chunk
