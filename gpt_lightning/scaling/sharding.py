"""Sharded data parallelism (FSDP2) for the GPT, applied under Lightning's ``ModelParallelStrategy``,
and the meta-device build that goes with it (no rank allocates or initializes the whole model).

Each ``Block`` becomes one FSDP unit (its parameters are all-gathered just before it runs and freed
after; a block's value embedding and gate, ``value_embeddings``, are its own and go with it), then
the root takes what is left: the embeddings (tied to the LM head), the final LayerNorm.
Parameters, gradients and AdamW's moments are then split across ranks instead of copied to each.
``fully_shard`` works in place, so ``state_dict`` keys stay ``transformer.h.N...``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from gpt_lightning.model import GPT

if TYPE_CHECKING:
    from lightning.pytorch import Trainer


def sharding_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 shards over, from ``ModelParallelStrategy``'s 2-D
    ``(data_parallel, tensor_parallel)`` mesh.

    gpt-lightning has no tensor parallelism, so both dimensions carry data parallelism and every
    rank reads its own batches:

    - one dimension of size 1: FSDP over the other, i.e. over all ranks. With the strategy's
      defaults on one node (``data_parallel_size`` = nodes = 1, ``tensor_parallel_size`` = GPUs),
      that is every GPU.
    - both larger than 1 (several nodes, the defaults): HSDP. Parameters are sharded across the
      inner dimension (the GPUs of a node, fast links) and replicated across the outer one (nodes),
      so only gradients cross the slower links, once per optimizer step (``sync_at_last_micro_batch``).
    """
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
    """Apply FSDP2 in place: ``fully_shard`` on every ``Block``, then on the root.

    Args:
        model: the GPT, still unsharded.
        mesh: 1-D (FSDP) or 2-D (HSDP) mesh, see ``sharding_mesh``.
        param_dtype: dtype the parameters are all-gathered and computed in (bf16 under
            ``bf16-mixed``: half the traffic and the memory of the gathered copies); gradients are
            still reduced in float32 and the sharded master weights stay float32. None keeps float32.
    """
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
    """``shard_gpt`` over ``ModelParallelStrategy``'s mesh, unless the model is sharded already
    (``configure_model`` runs again in each ``fit`` / ``validate``). Under ``bf16-mixed`` the
    parameters are gathered and computed in bf16."""
    if not isinstance(model, FSDPModule):
        shard_gpt(model, sharding_mesh(device_mesh), param_dtype=torch.bfloat16 if precision == "bf16-mixed" else None)


def sync_at_last_micro_batch(model: GPT, trainer: Trainer, batch_idx: int) -> None:
    """``on_train_batch_start``: under HSDP, all-reduce the gradients across replicas (nodes) only in
    the backward of an optimizer step's last micro-batch.

    With ``accumulate_grad_batches`` K, FSDP2 would otherwise all-reduce across nodes after each of
    the K backwards (Lightning's ``no_sync`` covers DDP only). The reduce-scatter within a node still
    runs every micro-batch, so gradients stay sharded: skipping it too
    (``set_requires_gradient_sync``) would hold a whole unsharded gradient per GPU across the
    micro-batches, the memory FSDP exists to save, to spare traffic on the fast links that overlaps
    the backward anyway. The sum is the same either way: the shards add up the micro-batches, and one
    all-reduce adds up the nodes. The last micro-batch is the one Lightning steps after: every K-th
    batch of the epoch, or the epoch's last. Plain FSDP (one mesh dimension) has no all-reduce.

    Args:
        model: the GPT, sharded or not (then nothing to do).
        trainer: the trainer running the step.
        batch_idx: the batch's index in the epoch, as Lightning gives the hook.
    """
    if isinstance(model, FSDPModule) and trainer.accumulate_grad_batches > 1:
        ready = batch_idx + 1  # batches of this epoch fetched so far, this one included
        last = ready % trainer.accumulate_grad_batches == 0 or trainer.is_last_batch or ready == trainer.num_training_batches
        model.set_requires_all_reduce(last)


def is_empty(model: GPT) -> bool:
    """Whether the GPT was built on the meta device and has no memory (nor values) yet."""
    return model.transformer.wte.weight.is_meta


def materialize(model: GPT, device: torch.device, rng_state: torch.Tensor) -> None:
    """Memory and GPT-2's initialization for a GPT built on the meta device (after sharding: each
    rank allocates only its shard, on ``device``). The values are those an eager build would have
    drawn from the generator state ``rng_state`` (``torch.random.get_rng_state()`` when it was
    built), so a sharded run starts from the weights a single-device run with the same seed starts from."""
    model.to_empty(device=device)
    model.tie_weights()  # the same Parameter already under FSDP2; a plain to_empty unties them
    model.init_weights(torch.Generator().set_state(rng_state))
