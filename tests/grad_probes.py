"""Callbacks the clipping and loss tests attach through the CLI: they measure, independently of
the module, what an optimizer step really did, and write it to a JSON file."""

import json
from pathlib import Path

import torch
from lightning.pytorch import Callback
from torch.distributed.tensor import DTensor


def _grads(pl_module) -> list[torch.Tensor]:
    """Every gradient, whole (an FSDP2 shard is gathered), as float32."""
    grads = [p.grad.detach() for p in pl_module.parameters() if p.grad is not None]
    return [(g.full_tensor() if isinstance(g, DTensor) else g).float() for g in grads]


class ClipProbe(Callback):
    """Per optimizer step: the gradients' global 2-norm and largest element before clipping (taken in
    the callbacks' ``on_before_optimizer_step``, which Lightning calls before the module's hook and
    the clipping) and after it (at batch end, after ``optimizer.step``, before the next step's
    ``zero_grad``). Under 16-mixed with fused AdamW the gradients are still multiplied by the
    GradScaler's scale before the step, so the "pre" figures are divided by it; the fused step
    unscales ``.grad`` in place, so the "post" figures are the true ones."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.steps: list[dict] = []

    def _scale(self, trainer) -> float:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        optimizer = trainer.optimizers[0]
        return (
            scaler.get_scale()
            if scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False)
            else 1.0
        )

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads, scale = _grads(pl_module), self._scale(trainer)
        self._pending = {
            "scale": scale,
            "pre_norm": float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
            / scale,
            "pre_max": max(float(g.abs().max()) for g in grads) / scale,
            "fused": bool(optimizer.defaults.get("fused")),
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        grads = _grads(pl_module)
        self.steps.append(
            {
                **self._pending,
                "post_norm": float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))),
                "post_max": max(float(g.abs().max()) for g in grads),
            }
        )

    def on_train_end(self, trainer, pl_module):
        self.out.write_text(json.dumps({"steps": self.steps}))


class StepLossProbe(Callback):
    """Per optimizer step: each micro-batch's loss, computed again here before the module's training
    step sees the batch (same weights: they change only at the step; same precision context; the
    model has no dropout), and the ``train/loss`` the module logged for the step."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.steps: list[dict] = []
        self._losses: list[float] = []
        self._step = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        x, y = batch
        with torch.no_grad(), trainer.precision_plugin.forward_context():
            self._losses.append(float(pl_module.model(x, y)[1]))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self._step:
            return  # mid-accumulation
        self._step = trainer.global_step
        logged = trainer.callback_metrics.get("train/loss")  # None before the first logging step
        self.steps.append({"micro_batch_losses": self._losses, "logged": None if logged is None else float(logged)})
        self._losses = []

    def on_train_end(self, trainer, pl_module):
        self.out.write_text(json.dumps({"steps": self.steps}))


class CollectiveCounter(Callback):
    """Per optimizer step, on each rank: the collectives ``torch.distributed`` ran during it, counted
    by wrapping its functions in this process (FSDP2 calls them through the module): reduce-scatters
    (FSDP2's, within the shard group), all-reduces over a group smaller than the world (HSDP's, across
    the replicas: nodes) and all-reduces of a 1-byte flag (the non-finite guard's); and a checksum of
    this rank's weights (its shards under FSDP2) after the step. With ``nan_step`` >= 0, rank
    ``nan_rank`` alone makes its loss NaN at that step's first micro-batch (after the module has seen
    the finite loss: only the gradients carry it), as one rank's bad batch would."""

    def __init__(self, out_dir: str, nan_step: int = -1, nan_rank: int = 1) -> None:
        self.out_dir = Path(out_dir)
        self.nan_step, self.nan_rank = nan_step, nan_rank
        self.steps: list[dict] = []
        self._counts = {"reduce_scatter": 0, "replica_all_reduce": 0, "flag_all_reduce": 0}
        self._step = 0

    def setup(self, trainer, pl_module, stage):
        import torch.distributed as dist

        def counted(real, kind_of):
            def wrapper(*args, **kwargs):
                kind = kind_of(*args, **kwargs)
                if kind:
                    self._counts[kind] += 1
                return real(*args, **kwargs)

            return wrapper

        def all_reduce_kind(tensor, op=None, group=None, *args, **kwargs):
            if tensor.dtype == torch.uint8:
                return "flag_all_reduce"
            return (
                "replica_all_reduce"
                if group is not None and dist.get_world_size(group) < dist.get_world_size()
                else None
            )

        # FSDP2's reduce-scatter: reduce_scatter_single in newer torch, reduce_scatter_tensor in torch 2.9
        name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
        setattr(dist, name, counted(getattr(dist, name), lambda *a, **k: "reduce_scatter"))
        dist.all_reduce = counted(dist.all_reduce, all_reduce_kind)

    def on_before_backward(self, trainer, pl_module, loss):
        if trainer.global_step == self.nan_step and trainer.global_rank == self.nan_rank:
            loss.mul_(float("nan"))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self._step:
            return  # mid-accumulation
        self._step = trainer.global_step
        weights = [p.detach() for p in pl_module.parameters()]
        checksum = sum(float((w.to_local() if isinstance(w, DTensor) else w).double().sum()) for w in weights)
        self.steps.append({**self._counts, "weights": checksum})
        self._counts = dict.fromkeys(self._counts, 0)
        self.out_dir.mkdir(parents=True, exist_ok=True)  # written every step: a run that stops on a NaN still leaves it
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps({"steps": self.steps}))


class LogCallsProbe(Callback):
    """Every ``self.log`` call the module makes during training, as (optimizer step, name), and
    ``callback_metrics``' ``train/loss`` at the end of fit."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.calls: list[tuple[int, str]] = []

    def on_train_start(self, trainer, pl_module):
        log = pl_module.log

        def recorded(name, *args, **kwargs):
            self.calls.append((trainer.global_step, name))
            return log(name, *args, **kwargs)

        pl_module.log = recorded

    def on_train_end(self, trainer, pl_module):
        final = trainer.callback_metrics.get("train/loss")
        self.out.write_text(json.dumps({"calls": self.calls, "final_loss": None if final is None else float(final)}))


class StopAtStep(Callback):
    """Stops the run in ``on_train_batch_end`` once ``step`` optimizer steps are done, as Lightning's
    ``Timer`` (``--trainer.max_time``) does when time is up."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True
