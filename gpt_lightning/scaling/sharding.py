"""FSDP2 for the GPT under Lightning's ``ModelParallelStrategy``: each ``Block`` one unit, in place (keys
unchanged), and the meta-device build that goes with it (docs/fsdp2.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from gpt_lightning.model import GPT
from gpt_lightning.precision import PRECISIONS

if TYPE_CHECKING:
    from lightning.pytorch import Trainer


def sharding_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over, from ``ModelParallelStrategy``'s 2-D mesh: a dimension of size 1 means
    FSDP over every rank, both larger than 1 HSDP (docs/fsdp2.md)."""
    if device_mesh.ndim != 2:
        return device_mesh
    outer, inner = device_mesh.mesh_dim_names or ("data_parallel", "tensor_parallel")
    if device_mesh[inner].size() == 1:
        return device_mesh[outer]
    if device_mesh[outer].size() == 1:
        return device_mesh[inner]
    return device_mesh  # 2-D: fully_shard replicates over dim 0 and shards over dim 1


def shard_count(device_mesh: DeviceMesh) -> int:
    """How many ranks share one copy of the weights: the size of the dimension FSDP2 shards over."""
    mesh = sharding_mesh(device_mesh)
    return mesh.size(mesh.ndim - 1)


def shard_gpt(model: GPT, mesh: DeviceMesh, param_dtype: torch.dtype | None = None) -> None:
    """Apply FSDP2 in place over ``mesh`` (1-D FSDP or 2-D HSDP, ``sharding_mesh``): ``fully_shard`` on every
    ``Block``, then on the root. Parameters are all-gathered and computed in ``param_dtype`` (None: float32),
    gradients reduced and master weights kept in float32."""
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    blocks = list(model.transformer.h)
    for i, block in enumerate(blocks):
        # The last block's backward starts right after the forward: keeping it gathered saves one
        # all-gather per step for one block's worth of memory.
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # Generation (forward_cached) and HellaSwag (logits_at) do not go through forward: they
    # all-gather the same way.
    register_fsdp_forward_method(model, "logits_at")
    for module in (model, *blocks):
        register_fsdp_forward_method(module, "forward_cached")


def shard_once(model: GPT, device_mesh: DeviceMesh, precision: str) -> None:
    """``shard_gpt`` over the strategy's mesh unless already sharded (``configure_model`` runs again in
    each ``fit`` / ``validate``); parameters gathered in autocast's dtype under a mixed precision without a
    GradScaler (bf16-mixed), else as stored (16-mixed's float32 too)."""
    if not isinstance(model, FSDPModule):
        p = PRECISIONS.get(precision)
        gather = p.matmul if p is not None and p.matmul != p.weights and not p.scaler else None
        shard_gpt(model, sharding_mesh(device_mesh), param_dtype=gather)


def sync_at_last_micro_batch(model: GPT, trainer: Trainer, batch_idx: int) -> None:
    """``on_train_batch_start``: under HSDP, all-reduce gradients across nodes only in an optimizer
    step's last micro-batch (Lightning's ``no_sync`` covers DDP only; an unsharded model: nothing). See docs/fsdp2.md."""
    if isinstance(model, FSDPModule) and trainer.accumulate_grad_batches > 1:
        ready = batch_idx + 1  # batches of this epoch fetched so far, this one included
        last = (
            ready % trainer.accumulate_grad_batches == 0
            or trainer.is_last_batch
            or ready == trainer.num_training_batches
        )
        model.set_requires_all_reduce(last)


def is_empty(model: GPT) -> bool:
    """Whether the GPT was built on the meta device and has no memory (nor values) yet."""
    return model.transformer.wte.weight.is_meta


def materialize(model: GPT, device: torch.device, rng_state: torch.Tensor) -> None:
    """Allocate and initialize a meta-device GPT (each rank its shard) with the values an eager build
    from ``rng_state`` would draw."""
    model.to_empty(device=device)
    model.tie_weights()  # the same Parameter already under FSDP2; a plain to_empty unties them
    model.init_weights(torch.Generator().set_state(rng_state))
