"""``GPTLightningModule``: the GPT trained by Lightning: optimizer, schedule, steps and in-place
``torch.compile``; each concern around them is a module of ``training`` or ``scaling``, called from a hook.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import MeanMetric
from torchmetrics.metric import CompositionalMetric

from gpt_lightning.averaging import (
    TrainedWeightsAtEnd,
    check_weight_averaging,
    train_on_from_trained_weights,
)
from gpt_lightning.host_memory import keep_freed_memory
from gpt_lightning.interop.checkpoint import refuse_unknown_settings
from gpt_lightning.loss import chunked_cross_entropy
from gpt_lightning.scaling.flops import training_flops
from gpt_lightning.scaling.sharding import is_empty, materialize, shard_once, sync_at_last_micro_batch
from gpt_lightning.training import resume
from gpt_lightning.training.architecture import DEFAULT_CONFIG, build_gpt
from gpt_lightning.training.attention import attention_context, device_attention_backends
from gpt_lightning.training.bits_per_byte import BitsPerByte, bits_and_bytes, token_byte_lengths
from gpt_lightning.training.checkpoint_io import use_atomic_checkpoints
from gpt_lightning.training.checks import (
    check_fits_data,
    check_optimizer_settings,
    check_strategy_supports,
    check_untied_rates,
    run_length,
)
from gpt_lightning.training.compilation import (
    check_cuda_graphs_accumulation,
    check_kernels_can_build,
    compile_in_place,
    compile_notice,
    evaluation_stance,
    is_compiled,
)
from gpt_lightning.training.nonfinite import NonFiniteGuard
from gpt_lightning.training.optimizers import build_optimizer, lr_multiplier, parameter_groups
from gpt_lightning.training.precision import check_float16_epsilon, warn_if_bf16_is_emulated
from gpt_lightning.training.step_loss import stopping, written_now


class GPTLightningModule(LightningModule):
    """GPT-2 language model trained with AdamW, or with Muon on the blocks' matrices (``optimizer``).

    Args:
        vocab_size: token-embedding rows; at least the tokenizer's 50257 (50304 is faster on GPUs).
        block_size: longest sequence. None: ``init_from``'s, else 1024; the CLI sets it from ``data.block_size``.
        n_layer: transformer blocks.
        n_head: attention heads per block.
        n_embd: residual-stream width; divisible by ``n_head``.
        dropout: dropout probability (0 for short runs).
        bias: biases in Linear and LayerNorm layers, as in GPT-2.
        rotary: rotary position embeddings instead of the learned table (docs/modern.md, as every switch).
        rotary_base: the rotary embedding's longest wavelength, in positions.
        norm: "layernorm" (GPT-2) or "rmsnorm".
        norm_affine: learned gains (and biases) in the norms; False: parameter-free.
        qk_norm: RMS-normalize each head's queries and keys.
        activation: the MLP's "gelu" (GPT-2's tanh GELU) or "relu2" (ReLU squared).
        tie_embeddings: share the LM head with the token embedding (GPT-2); False: each its own.
        zero_init_proj: start the residual output projections and an untied head at zero.
        logit_softcap: squash the logits to (-c, c) by c * tanh(logits / c); None: no cap.
        value_embeddings: nanochat's value embeddings on every other block.
        window_pattern: sliding-window attention, a letter per block, tiled: "S" short, "L" long (e.g. "SSSL").
        short_window_fraction: an "S" block's window as a fraction of ``block_size``.
        residual_scalars: nanochat's per-block residual and x0 scalars (``GPTConfig``), trained by AdamW, no decay.
        optimizer: "adamw", or "muon" (torch >= 2.9) on the blocks' matrices and AdamW on the rest; not under FSDP2.
        learning_rate: AdamW peak learning rate.
        weight_decay: AdamW weight decay, of 2-D weights only (matmuls, embeddings; not biases, LayerNorm gains).
        betas: AdamW moment coefficients.
        eps: AdamW epsilon.
        muon_learning_rate: Muon's peak learning rate; the schedule scales it as it scales ``learning_rate``.
        muon_momentum: Muon's Nesterov momentum.
        muon_weight_decay: Muon's decoupled weight decay (each step multiplies the matrices by 1 - lr x this).
        muon_adjust_lr: Muon's per-shape lr scale: "original" (lr about 0.02) or "match_rms_adamw" (an AdamW-like lr).
        embedding_learning_rate: AdamW peak rate of the embeddings when the head is untied; None: ``learning_rate``.
        head_learning_rate: AdamW peak rate of the untied LM head; None: ``learning_rate``.
        warmup_steps: linear learning-rate warm-up from 0 over this many optimizer steps.
        lr_schedule: after warm-up, "cosine" or "wsd": constant, then linear decay over the last ``decay_fraction``.
        cosine_decay_steps: cosine decay to ``min_lr_ratio`` x peak over this many steps, then constant; None: none.
        decay_fraction: the fraction of the run's steps the "wsd" schedule decays over, at its end.
        min_lr_ratio: final learning rate of the decay, as a fraction of the peak.
        compile: ``torch.compile`` the model in place (checkpoint keys stay plain); the first step compiles.
        compile_scope: "model": one graph for the GPT; "blocks": one reused by every ``Block``, one for the head.
        compile_mode: ``torch.compile`` mode: None (default), "max-autotune", ... (no CUDA graphs with accumulation).
        compile_dynamic: ``torch.compile(dynamic=...)``; False suits the fixed (B, T) batches.
        compile_fullgraph: fail on any graph break instead of falling back to eager.
        compile_eval: compile evaluation too (a second graph, at the first validation); for long evaluations.
        activation_checkpointing: recompute each block's activations in the backward pass: less memory.
        chunked_loss: the training loss a chunk of rows at a time, never all (B, T, vocab_size) logits. None: on CPUs.
        cudnn_attention: try cuDNN's attention first in training, on GPUs of compute capability >= 9.0 (unmeasured).
        float32_matmul_precision: set when ``fit`` starts ("high": TF32 on Ampere and newer); None: left alone.
        val_sample_tokens: tokens the ``ValidationSamples`` callback samples after each validation. 0: off.
        val_sample_prompt: the prompt for those samples.
        init_from: start from a Hugging Face GPT-2 (``gpt2`` ... ``gpt2-xl``, or a local export); its architecture
            fills the options left at their defaults. A resumed run ignores it.
    """

    def __init__(
        self,
        vocab_size: int = DEFAULT_CONFIG.vocab_size,
        block_size: int | None = None,
        n_layer: int = DEFAULT_CONFIG.n_layer,
        n_head: int = DEFAULT_CONFIG.n_head,
        n_embd: int = DEFAULT_CONFIG.n_embd,
        dropout: float = DEFAULT_CONFIG.dropout,
        bias: bool = DEFAULT_CONFIG.bias,
        rotary: bool = DEFAULT_CONFIG.rotary,
        rotary_base: float = DEFAULT_CONFIG.rotary_base,
        norm: Literal["layernorm", "rmsnorm"] = DEFAULT_CONFIG.norm,
        norm_affine: bool = DEFAULT_CONFIG.norm_affine,
        qk_norm: bool = DEFAULT_CONFIG.qk_norm,
        activation: Literal["gelu", "relu2"] = DEFAULT_CONFIG.activation,
        tie_embeddings: bool = DEFAULT_CONFIG.tie_embeddings,
        zero_init_proj: bool = DEFAULT_CONFIG.zero_init_proj,
        logit_softcap: float | None = DEFAULT_CONFIG.logit_softcap,
        value_embeddings: bool = DEFAULT_CONFIG.value_embeddings,
        window_pattern: str = DEFAULT_CONFIG.window_pattern,
        short_window_fraction: float = DEFAULT_CONFIG.short_window_fraction,
        residual_scalars: bool = DEFAULT_CONFIG.residual_scalars,
        optimizer: Literal["adamw", "muon"] = "adamw",
        learning_rate: float = 1e-3,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        muon_learning_rate: float = 0.02,
        muon_momentum: float = 0.95,
        muon_weight_decay: float = 0.0,
        muon_adjust_lr: Literal["original", "match_rms_adamw"] = "original",
        embedding_learning_rate: float | None = None,
        head_learning_rate: float | None = None,
        warmup_steps: int = 0,
        lr_schedule: Literal["cosine", "wsd"] = "cosine",
        cosine_decay_steps: int | None = None,
        decay_fraction: float = 0.2,
        min_lr_ratio: float = 0.1,
        compile: bool = True,
        compile_scope: Literal["model", "blocks"] = "blocks",
        compile_mode: str | None = None,
        compile_dynamic: bool | None = False,
        compile_fullgraph: bool = False,
        compile_eval: bool = False,
        activation_checkpointing: bool = False,
        chunked_loss: bool | None = None,
        cudnn_attention: bool = False,
        float32_matmul_precision: Literal["highest", "high", "medium"] | None = None,
        val_sample_tokens: int = 48,
        val_sample_prompt: str = "\n",
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        check_optimizer_settings(self.hparams)
        self.config, self.model, to_record = build_gpt(self.hparams)
        self.save_hyperparameters(to_record)  # checkpoints record the architecture built, without init_from
        check_untied_rates(self.config, embedding_learning_rate, head_learning_rate)
        self._init_rng_state = torch.random.get_rng_state() if is_empty(self.model) else None
        self.model.activation_checkpointing = activation_checkpointing
        with torch.device("cpu"):  # a few scalars: real even when the model is built on the meta device
            self.val_loss = MeanMetric()  # token-weighted mean, reduced across ranks at compute()
            self.val_perplexity = CompositionalMetric(torch.exp, self.val_loss, None)  # exp of val_loss's compute()
            self.val_bpb = BitsPerByte()  # bits over bytes, each summed across ranks at compute()
        self._byte_lengths: torch.Tensor | None = None  # (vocab_size,) on the device, at the first validation
        self._nonfinite = NonFiniteGuard()  # see on_before_optimizer_step
        self._step_losses: list[torch.Tensor] = []  # this optimizer step's micro-batch losses, on the device
        self._total_steps: int | None = None  # the run's optimizer steps, for the "wsd" schedule
        self._final_step: int | None = None  # the same, for logging its last step (None: no end)
        self._step_values: tuple[torch.Tensor | None, torch.Tensor | None] | None = None  # this step's loss, grad norm
        self._built: tuple[torch.optim.Optimizer, LambdaLR | None] | None = None  # by configure_optimizers
        self._trained_at_end = TrainedWeightsAtEnd()  # for a last.ckpt written after weight averaging's end

    def configure_callbacks(self) -> list:
        """None; applies ``float32_matmul_precision`` in this first hook, before the device is set up, and
        refuses a weight-averaging callback where it cannot run (before its ``setup`` copies the model)."""
        self._apply_matmul_precision()
        if self._trainer is not None and self._trainer.state.fn == TrainerFn.FITTING:
            check_weight_averaging(self._trainer)
        return []

    def _apply_matmul_precision(self) -> None:
        if self.hparams.float32_matmul_precision is not None:
            torch.set_float32_matmul_precision(self.hparams.float32_matmul_precision)

    def setup(self, stage: str) -> None:
        self._apply_matmul_precision()  # again, for a subclass whose configure_callbacks does not call ours
        check_fits_data(self.config, self.trainer.datamodule)
        check_strategy_supports(self.hparams.optimizer, self.trainer.strategy)
        hp, trainer = self.hparams, self.trainer
        check_cuda_graphs_accumulation(
            hp.compile, hp.compile_mode, trainer.accumulate_grad_batches, trainer.strategy.root_device
        )
        use_atomic_checkpoints(trainer)  # here, so a plain Trainer's saves are atomic too
        if stage == "fit" and trainer.strategy.root_device.type == "cpu":
            keep_freed_memory()  # a CPU step's temporaries reuse the heap, not fresh pages (host_memory)
        warn_if_bf16_is_emulated(trainer)  # here, so a plain Trainer's and a stock LightningCLI's runs are told too

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint this run cannot go on from (``resume``); train on from its trained weights (``averaging``)."""
        path = self._trainer.ckpt_path if self._trainer is not None else None
        source = f"Checkpoint {path}" if path else "The checkpoint"
        refuse_unknown_settings(checkpoint.get("hyper_parameters") or {}, self.hparams, source)
        resume.refuse_other_architecture(checkpoint, self.config)
        resume.refuse_other_optimizer(checkpoint, self.hparams.optimizer)
        if self._trainer is not None:
            train_on_from_trained_weights(checkpoint, self._trainer)

    def configure_model(self) -> None:
        """Shard under ``ModelParallelStrategy`` (FSDP2), give a meta-device build its memory and
        values, then compile; all in place, so ``state_dict`` keys stay ``model.transformer...``."""
        if self.device_mesh is not None:
            shard_once(self.model, self.device_mesh, str(self.trainer.precision))
        if is_empty(self.model):
            device = self.trainer.strategy.root_device if self._trainer is not None else torch.device("cpu")
            materialize(self.model, device, self._init_rng_state)
        hp = self.hparams
        if hp.compile:  # checked again by a Trainer: a model loaded compiled outside one did not know its device
            check_kernels_can_build(self.trainer.strategy.root_device.type if self._trainer is not None else None)
        if hp.compile and not self.is_compiled:
            options = dict(mode=hp.compile_mode, dynamic=hp.compile_dynamic, fullgraph=hp.compile_fullgraph)
            compile_in_place(self.model, hp.compile_scope, **options)

    @property
    def is_compiled(self) -> bool:  # whether the model (or, by regions, its blocks) runs compiled
        return is_compiled(self.model)

    def on_fit_start(self) -> None:
        check_float16_epsilon(self.trainer.optimizers)  # the optimizer built, ours or an --optimizer
        if self.is_compiled:  # say what the first step's wait is, before it starts
            rank_zero_info(compile_notice(self.hparams.compile_scope, self.hparams.compile_eval))

    def on_train_start(self) -> None:
        """Give the optimizer ``configure_optimizers`` built the settings and schedule given now, and keep the
        restored step from being saved again mid-step (``resume``)."""
        groups = parameter_groups(self.model, self.hparams)
        resume.continue_own_schedule(self.trainer, self._built, groups, self.lr_multiplier)
        resume.keep_the_restored_step(self.trainer)
        steps = self.trainer.estimated_stepping_batches
        self._final_step = None if steps == float("inf") else int(steps)

    def training_flops(self, batch_size: int, seq_len: int) -> float:
        """FLOPs of one training step (forward + backward) on a (batch_size, seq_len) batch, for MFU."""
        return training_flops(self.config, batch_size, seq_len)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        return self.model(idx, targets)  # (B, T, vocab_size) logits, and the loss given targets

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        backends = device_attention_backends(x.device, cudnn_attention=self.hparams.cudnn_attention)
        with attention_context(backends):  # outside the compiled regions
            return self.model(x, y, head_loss=chunked_cross_entropy if self.uses_chunked_loss(x.device) else None)[1]

    def uses_chunked_loss(self, device: torch.device) -> bool:
        """Whether the training loss runs a chunk of rows at a time on ``device`` (``chunked_loss``)."""
        return device.type != "cuda" if self.hparams.chunked_loss is None else self.hparams.chunked_loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self._nonfinite.observe_loss(loss)
        self._step_losses.append(loss.detach())  # their mean logged once per optimizer step
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        losses, self._step_losses = self._step_losses, []
        loss = torch.stack(losses).mean() if losses else None
        self._nonfinite.before_optimizer_step(self, optimizer)  # skips a non-finite update on the device
        self._step_values = (loss, self._nonfinite.grad_norm)  # also for on_train_batch_end, at a stop
        if written_now(self.trainer, self._final_step):  # other steps log nothing: no host cost (step_loss)
            self._log_step(*self._step_values)

    def _log_step(self, loss: torch.Tensor | None, grad_norm: torch.Tensor | None) -> None:
        if loss is not None:
            self.log("train/loss", loss, sync_dist=True)  # the mean over micro-batches and ranks
        if grad_norm is not None:
            self.log("train/grad_norm", grad_norm)  # before clipping; the same on every rank

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """``--trainer.gradient_clip_val`` on the device with the guard's norm, fused AdamW kept (``nonfinite``)."""
        self._nonfinite.clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        resume.align_logging_step(self.trainer)  # after some resumes Lightning's is one ahead
        sync_at_last_micro_batch(self.model, self.trainer, batch_idx)  # HSDP: across nodes once per optimizer step

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._nonfinite.check_at_logging_interval(self.trainer)
        if self._step_values is not None and stopping(self.trainer):
            self._log_step(*self._step_values)
        self._step_values = None

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._nonfinite.raise_if_found(self.global_step)  # no checkpoint is written after a bad step
        self._trained_at_end.put_in(checkpoint)

    def on_train_epoch_end(self) -> None:
        self._trained_at_end.keep(self.trainer, self)

    def on_train_end(self) -> None:
        self._trained_at_end.drop()
        self._nonfinite.raise_if_found(self.global_step)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch  # (B, T), (B, T)
        with evaluation_stance(self.hparams.compile_eval, self._trainer is not None and self._trainer.sanity_checking):
            logits, loss = self.model(x, y)  # (B, T, vocab_size), mean over tokens
        self.val_loss.update(loss, weight=x.numel())
        if self._byte_lengths is None or self._byte_lengths.device != y.device:
            self._byte_lengths = token_byte_lengths(self.config.vocab_size).to(y.device)  # once: no host read per step
        self.val_bpb.update(*bits_and_bytes(logits, y, self._byte_lengths))

    test_step = validation_step  # the same loss, logged as test/ by on_test_epoch_end

    def on_validation_epoch_start(self) -> None:
        """Sum the metrics in float32 and float64 whatever the precision: ``*-true`` precisions cast the
        metric states too, and a float16 sum of losses overflows."""
        self.val_loss.set_dtype(torch.float32)
        self.val_bpb.set_dtype(torch.float64)

    on_test_epoch_start = on_validation_epoch_start

    def _log_eval(self, prefix: str) -> None:
        # The metric objects, not tensors: they reduce over ranks themselves at compute().
        metrics = {"loss": self.val_loss, "perplexity": self.val_perplexity, "bpb": self.val_bpb}  # bpb: bits per byte
        fitting = self.trainer.state.fn == TrainerFn.FITTING
        for name, metric in metrics.items():
            self.log(
                f"{prefix}/{name}",
                metric,
                prog_bar=name == "loss" and prefix == "val",
                logger=False if fitting else None,
            )
        if fitting and self.loggers and not self.trainer.sanity_checking:
            # At the optimizer steps done, as eval/* and the checkpoints' step=N (Lightning's step is one less).
            values = {f"{prefix}/{name}": metric.compute().item() for name, metric in metrics.items()}
            values["epoch"] = self.current_epoch  # as Lightning adds it to every row it logs
            for logger in self.loggers:
                logger.log_metrics(values, step=self.global_step)

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        optimizer = build_optimizer(self.model, hp, fused=self.device.type in ("cuda", "cpu") or None)
        if hp.lr_schedule == "wsd":
            self._total_steps = run_length(self.trainer.estimated_stepping_batches)
        elif hp.warmup_steps == 0 and hp.cosine_decay_steps is None:
            self._built = (optimizer, None)
            return optimizer
        scheduler = LambdaLR(optimizer, self.lr_multiplier)  # every group's peak x the same multiplier
        self._built = (optimizer, scheduler)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_multiplier(self, step: int) -> float:
        """Learning rate at optimizer step ``step`` as a fraction of the peak."""
        schedule = ("warmup_steps", "lr_schedule", "cosine_decay_steps", "decay_fraction", "min_lr_ratio")
        return lr_multiplier(step, **{name: self.hparams[name] for name in schedule}, total_steps=self._total_steps)
