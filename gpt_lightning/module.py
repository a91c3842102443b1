"""``GPTLightningModule``: the GPT wrapped for Lightning, with AdamW and in-place ``torch.compile``."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any, ContextManager, Literal

import torch
from lightning.fabric.utilities.throughput import measure_flops
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.fsdp import FSDPModule
from torch.optim.lr_scheduler import LambdaLR
from torchmetrics import MeanMetric

from gpt_lightning.compilation import compile_notice, evaluation_stance
from gpt_lightning.errors import UserError
from gpt_lightning.model import GPT, GPTConfig
from gpt_lightning.nonfinite import NonFiniteGuard
from gpt_lightning.pretrained import agree_with_pretrained
from gpt_lightning.sharding import shard_gpt, sharding_mesh
from gpt_lightning.data.tokenizer import gpt2_encoding

_DEFAULT = GPTConfig()  # the architecture defaults live in GPTConfig alone
# The GPTConfig fields a resumed run must share with its checkpoint. Dropout is a training setting:
# it changes no weight and no function at inference, so it may change on resume.
ARCHITECTURE = tuple(f.name for f in fields(GPTConfig) if f.name != "dropout")


def _architecture_of(state_dict: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The GPTConfig fields that a checkpoint's weight shapes pin down."""
    if "model.transformer.wte.weight" not in state_dict:
        return {}
    vocab_size, n_embd = state_dict["model.transformer.wte.weight"].shape
    layers = {key.split(".")[3] for key in state_dict if key.startswith("model.transformer.h.")}
    return {
        "vocab_size": vocab_size,
        "n_embd": n_embd,
        "block_size": state_dict["model.transformer.wpe.weight"].shape[0],
        "n_layer": len(layers),
        "bias": "model.transformer.h.0.attn.c_attn.bias" in state_dict,
    }


class GPTLightningModule(LightningModule):
    """GPT-2 language model trained with AdamW.

    Args:
        vocab_size: token-embedding rows; at least the tokenizer's 50257 (50304 is faster on GPUs).
        block_size: longest sequence, the size of the position table. None: with ``init_from``,
            the source's table (the training length is not the model's context); otherwise
            GPTConfig's 1024. The CLI sets it to ``data.block_size`` unless it is given or
            ``init_from`` is set.
        n_layer: transformer blocks.
        n_head: attention heads per block.
        n_embd: residual-stream width; divisible by ``n_head``.
        dropout: dropout probability (0 for short runs).
        bias: biases in Linear and LayerNorm layers, as in GPT-2.
        learning_rate: AdamW peak learning rate.
        weight_decay: AdamW decoupled weight decay, applied to 2-D weights (matmuls, embeddings)
            only; biases and LayerNorm gains are never decayed.
        betas: AdamW moment coefficients.
        eps: AdamW epsilon.
        warmup_steps: linear learning-rate warm-up from 0 over this many optimizer steps.
        cosine_decay_steps: if set, cosine decay from the peak to ``min_lr_ratio`` x peak over this
            many steps after warm-up, then constant. None keeps the rate constant after warm-up
            (the reference experiment: constant 1e-3).
        min_lr_ratio: final learning rate of the cosine schedule, as a fraction of the peak.
        compile: compile the model with ``torch.compile`` in place in ``configure_model``, so
            checkpoint keys stay plain. The first steps then include compilation.
        compile_scope: what one ``torch.compile`` graph captures. "model": the whole GPT. "blocks":
            each transformer ``Block`` (one graph, reused by every block) plus the final LayerNorm,
            LM head and loss as one more region; the embeddings stay eager. Regional compilation
            compiles the repeated block once instead of n_layer times. Measured on GPT-2 124M
            (benchmarks/results): first step 22 s instead of 39 s, steady state 1.09x, on 2 CPU cores.
        compile_mode: ``torch.compile`` mode: None (default), "reduce-overhead", "max-autotune", ...
        compile_dynamic: ``torch.compile(dynamic=...)``; False suits the fixed (B, T) batches.
        compile_fullgraph: fail on any graph break instead of falling back to eager.
        compile_eval: run validation and test batches through the compiled model too: a second graph
            (no gradients), compiled at the first validation after the sanity check, which always
            runs eager. Worth it only for long evaluations; False (the default) runs evaluation and
            the validation samples eager, the same code and weights (``gpt_lightning.compilation``).
        activation_checkpointing: recompute each block's activations in the backward pass instead
            of keeping them: activation memory drops to one (B, T, n_embd) tensor per block plus one
            block's worth, for about a third more compute. For models or batches that do not fit.
        float32_matmul_precision: ``torch.set_float32_matmul_precision`` value set in ``setup``;
            "high" allows TF32 on Ampere and newer GPUs. None leaves the process setting alone.
        val_sample_tokens: after each validation, sample this many tokens from ``val_sample_prompt``
            and log the text to TensorBoard (tag ``samples``), so you can watch the model learn.
            0 turns it off.
        val_sample_prompt: the prompt for those samples.
        init_from: start from a GPT-2 checkpoint in Hugging Face format: a hub name (``gpt2``,
            ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``; fetched once through huggingface_hub's
            cache) or a local directory or weights file with its ``config.json``. Its config gives
            the architecture: options left at their defaults take its values, one set otherwise must
            agree; ``block_size`` may be shorter (the position table is cropped). Checkpoints of the
            run record the architecture, so they load without it. A resumed run ignores it.
    """

    def __init__(
        self,
        vocab_size: int = _DEFAULT.vocab_size,
        block_size: int | None = None,
        n_layer: int = _DEFAULT.n_layer,
        n_head: int = _DEFAULT.n_head,
        n_embd: int = _DEFAULT.n_embd,
        dropout: float = _DEFAULT.dropout,
        bias: bool = _DEFAULT.bias,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.01,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        cosine_decay_steps: int | None = None,
        min_lr_ratio: float = 0.1,
        compile: bool = True,
        compile_scope: Literal["model", "blocks"] = "blocks",
        compile_mode: str | None = None,
        compile_dynamic: bool | None = False,
        compile_fullgraph: bool = False,
        compile_eval: bool = False,
        activation_checkpointing: bool = False,
        float32_matmul_precision: Literal["highest", "high", "medium"] | None = None,
        val_sample_tokens: int = 48,
        val_sample_prompt: str = "\n",
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        if not learning_rate > 0:
            raise UserError(f"model.learning_rate must be > 0, got {learning_rate!r}.")
        if weight_decay < 0:
            raise UserError(f"model.weight_decay must be >= 0, got {weight_decay!r}.")
        if warmup_steps < 0 or (cosine_decay_steps is not None and cosine_decay_steps <= 0):
            raise UserError("model.warmup_steps must be >= 0 and model.cosine_decay_steps > 0.")
        self.save_hyperparameters()
        pretrained_state = None
        if init_from is not None:
            given = dict(block_size=block_size, vocab_size=vocab_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd, bias=bias)
            architecture, pretrained_state = agree_with_pretrained(given, init_from)
            # Checkpoints of this run record the architecture and load without the source.
            self.save_hyperparameters({**architecture, "init_from": None, "pretrained_from": init_from})
            block_size, vocab_size, n_layer, n_head, n_embd, bias = (architecture[k] for k in given)
        elif block_size is None:
            block_size = _DEFAULT.block_size
            self.save_hyperparameters({"block_size": block_size})  # checkpoints record the size built
        try:
            self.config = GPTConfig(
                block_size=block_size, vocab_size=vocab_size, n_layer=n_layer,
                n_head=n_head, n_embd=n_embd, dropout=dropout, bias=bias,
            )
        except ValueError as err:
            hint = " (the CLI sets it from data.block_size)" if "block_size" in str(err) else ""
            raise UserError(str(err).replace("GPTConfig.", "model.") + hint) from err
        if pretrained_state is not None:
            self.model = GPT.from_state_dict(self.config, pretrained_state)  # no random init, no copy
        else:
            # Built where the caller builds: on the CPU, randomly initialized; or, under
            # torch.device("meta") (trainer.init_module(empty_init=True), and the CLI under
            # ModelParallelStrategy), empty until configure_model shards it and initializes each
            # rank's shard with the values an eager build here would have drawn.
            self.model = GPT(self.config)
        self._init_rng_state = torch.random.get_rng_state() if self._model_is_empty() else None
        self.model.activation_checkpointing = activation_checkpointing
        with torch.device("cpu"):  # a few scalars: real even when the model is built on the meta device
            self.val_loss = MeanMetric()  # token-weighted mean, reduced across ranks at compute()
        self._nonfinite = NonFiniteGuard()
        self._nonfinite_checked_at = -1
        self._step_loss_sum: torch.Tensor | None = None  # this optimizer step's micro-batch losses, summed
        self._step_micro_batches = 0
        self._flops_cache: dict[tuple[int, int], float] = {}

    # --- setup hooks -----------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        if self.hparams.float32_matmul_precision is not None:
            torch.set_float32_matmul_precision(self.hparams.float32_matmul_precision)
        data_vocab_size = getattr(self.trainer.datamodule, "vocab_size", None)
        if data_vocab_size is not None and data_vocab_size > self.config.vocab_size:
            raise UserError(
                f"model.vocab_size ({self.config.vocab_size}) is smaller than the tokenizer's {data_vocab_size} "
                f"tokens: ids from {self.config.vocab_size} up would have no embedding row. Use "
                f"--model.vocab_size {data_vocab_size} (or 50304, a multiple of 64 that is faster on GPUs)."
            )
        data_block_size = getattr(self.trainer.datamodule, "block_size", None)
        if data_block_size is not None and data_block_size > self.config.block_size:
            raise UserError(
                f"data.block_size ({data_block_size}) is larger than the model's block_size "
                f"({self.config.block_size}): the model has no position embedding past "
                f"{self.config.block_size}. Use data.block_size <= {self.config.block_size}."
            )

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of another architecture with a message that names the difference, and
        let the optimizer settings of this module (the ones the user gave now) win over the saved ones."""
        saved = {
            # Every architecture field the checkpoint recorded (n_head changes no shape, yet the
            # computation), then what the weights' shapes show, which wins: load_from_checkpoint
            # writes its keyword arguments over the recorded ones.
            **{name: value for name, value in (checkpoint.get("hyper_parameters") or {}).items() if name in ARCHITECTURE},
            **_architecture_of(checkpoint.get("state_dict", {})),
        }
        differences = [
            f"{name}: checkpoint {value}, this model {getattr(self.config, name)}"
            for name, value in saved.items()
            if value != getattr(self.config, name)
        ]
        if differences:
            raise UserError(
                "The checkpoint is of another architecture (" + "; ".join(differences) + "). "
                "Use the checkpoint's architecture (its config.yaml / hparams.yaml) or start a new run."
            )
        self._apply_optimizer_settings(checkpoint)

    def _apply_optimizer_settings(self, checkpoint: dict[str, Any]) -> None:
        """Rewrite the restored AdamW and scheduler state with this module's lr, betas, eps and weight
        decay, keeping the moments and the schedule's position: a learning rate given on resume is the
        one training continues with (scaled by the schedule, if any), not the one saved."""
        hp = self.hparams
        saved_lr = (checkpoint.get("hyper_parameters") or {}).get("learning_rate") or hp.learning_rate
        scale = hp.learning_rate / saved_lr
        if "optimizer_states" in checkpoint:  # restored from this dict after this hook
            param_groups = [group for state in checkpoint["optimizer_states"] for group in state.get("param_groups", [])]
        else:  # ModelParallelStrategy loaded the (sharded) optimizer in place before this hook
            optimizers = self._trainer.optimizers if self._trainer is not None else []  # none: load_from_checkpoint
            param_groups = [group for optimizer in optimizers for group in optimizer.param_groups]
        # configure_optimizers builds two groups: decayed weights, then never-decayed vectors
        for group, weight_decay in zip(param_groups, (hp.weight_decay, 0.0) * len(param_groups)):
            group["lr"] *= scale
            if "initial_lr" in group:
                group["initial_lr"] = hp.learning_rate
            group.update(betas=tuple(hp.betas), eps=hp.eps, weight_decay=weight_decay)
        for scheduler in checkpoint.get("lr_schedulers") or []:
            for key in ("base_lrs", "_last_lr"):
                if key in scheduler:
                    scheduler[key] = [lr * scale for lr in scheduler[key]]

    def configure_model(self) -> None:
        """Shard under ``ModelParallelStrategy`` (FSDP2, see ``gpt_lightning.sharding``), then compile.

        Both work in place: ``state_dict`` keys stay ``model.transformer...`` (no ``_orig_mod.``).
        """
        if self.device_mesh is not None and not isinstance(self.model, FSDPModule):
            bf16 = str(self.trainer.precision) == "bf16-mixed"
            shard_gpt(self.model, sharding_mesh(self.device_mesh), param_dtype=torch.bfloat16 if bf16 else None)
        if self._model_is_empty():
            self._materialize()
        if not self.hparams.compile or self.is_compiled:
            return
        options = dict(
            mode=self.hparams.compile_mode, dynamic=self.hparams.compile_dynamic, fullgraph=self.hparams.compile_fullgraph
        )
        if self.hparams.compile_scope == "model":
            self.model.compile(**options)
            return
        for block in self.model.transformer.h:
            block.compile(**options)  # in place, like the whole model: same code, one graph for all
        # A method, not a module: compiling it leaves every parameter name as it is.
        self.model.head_and_loss = torch.compile(self.model.head_and_loss, **options)

    def _model_is_empty(self) -> bool:
        """Whether the GPT was built on the meta device and has no memory (nor values) yet."""
        return self.model.transformer.wte.weight.is_meta

    def _materialize(self) -> None:
        """Memory and GPT-2's initialization for a model built on the meta device, after sharding:
        each rank allocates only its shard, on the strategy's device. The values are those an eager
        build in ``__init__`` would have drawn (same generator state), so a sharded run starts from
        the weights a single-device run with the same seed starts from."""
        device = self.trainer.strategy.root_device if self._trainer is not None else torch.device("cpu")
        self.model.to_empty(device=device)
        self.model.tie_weights()  # the same Parameter already under FSDP2; a plain to_empty unties them
        self.model.init_weights(torch.Generator().set_state(self._init_rng_state))

    @property
    def is_compiled(self) -> bool:
        """Whether the model (or, compiled by regions, its blocks) runs through ``torch.compile``."""
        return any(
            getattr(module, "_compiled_call_impl", None) is not None for module in (self.model, self.model.transformer.h[0])
        )

    def on_fit_start(self) -> None:
        if self.is_compiled:  # say what the first step's wait is, before it starts
            rank_zero_info(compile_notice(self.hparams.compile_scope, self.hparams.compile_eval))

    def training_flops(self, batch_size: int, seq_len: int) -> float:
        """FLOPs of one training step (forward + backward) on a (batch_size, seq_len) batch.

        Counted once by Lightning's ``measure_flops`` on a meta-device copy of the architecture
        (no memory, no compute): every matmul, attention's included.
        """
        key = (batch_size, seq_len)
        if key not in self._flops_cache:
            with torch.device("meta"):
                model = GPT(self.config)
                x = torch.zeros(batch_size, seq_len, dtype=torch.long)
            self._flops_cache[key] = float(measure_flops(model, lambda: model(x, x)[1], lambda loss: loss))
        return self._flops_cache[key]

    # --- steps -----------------------------------------------------------------------------------
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        return self.model(idx, targets)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        _, loss = self.model(x, y)
        return loss

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self._nonfinite.observe_loss(loss)
        # Summed on the device over the optimizer step's micro-batches; logged as their mean in
        # on_before_optimizer_step, once per optimizer step (see _log_step_loss).
        detached = loss.detach()
        self._step_loss_sum = detached if self._step_loss_sum is None else self._step_loss_sum + detached
        self._step_micro_batches += 1
        return loss

    def _log_step_loss(self) -> None:
        """Log ``train/loss``: the mean over this optimizer step's micro-batches (all of equal size)
        and over ranks, as build-nanogpt's ``loss_accum``; not the last micro-batch's loss.

        Not prog_bar: Lightning turns every prog_bar value into a Python number after every batch,
        a host read each step. StepProgressBar reads it at logging intervals instead.
        """
        if self._step_loss_sum is None:
            return
        mean = self._step_loss_sum / self._step_micro_batches  # on the device: no host read
        self._step_loss_sum, self._step_micro_batches = None, 0
        if self._loss_is_written_now():
            self.log("train/loss", mean, sync_dist=True)  # the mean over ranks

    def _loss_is_written_now(self) -> bool:
        """Whether the logger writes this step's ``train/loss``. With several processes the loss is
        logged only then: ``sync_dist`` puts a host-blocking barrier before its all-reduce, which on
        every step would stall the GPU queue. Other steps leave ``callback_metrics`` at the last
        written value. One process logs every step (there is nothing to synchronize)."""
        trainer = self.trainer
        if trainer.world_size == 1 or trainer.fast_dev_run or trainer.should_stop:
            return True
        every = trainer.log_every_n_steps
        # the condition Lightning's logger connector applies after this batch (global_step is the
        # number of optimizer steps done before this one)
        return every > 0 and (trainer.global_step + 1) % every == 0

    # --- non-finite losses and gradients, without a per-step host sync -----------------------------
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._log_step_loss()
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)  # 16-mixed: it handles overflows
        grads = self._gradients()
        skip = self._nonfinite.skip_update(self.global_step, None if scaler is not None else grads)
        if self._nonfinite.grad_norm is not None:
            # Before the gradient clipping of configure_gradient_clipping; a device tensor, read only
            # when the logger writes it. Identical on every rank: the gradients are all-reduced.
            self.log("train/grad_norm", self._nonfinite.grad_norm)
        if self._unscaled_in_step(optimizer):
            # 16-mixed with fused AdamW: the GradScaler checks the gradients inside optimizer.step and
            # skips an update whose gradients are not finite (an fp16 overflow, routine: it lowers
            # its scale). A non-finite loss is an error; its gradients are made non-finite on the
            # device, so the scaler skips that update and every later one until the host reads the
            # guard at the next logging interval.
            if grads:
                grads[0].masked_fill_(skip, float("nan"))
        elif scaler is None and optimizer.defaults.get("fused"):
            optimizer.found_inf = skip.float()  # the fused kernel leaves weights and moments untouched
        elif bool(skip):
            # A non-fused optimizer (not one gpt-lightning builds on CPU or CUDA) cannot skip on the
            # device: decide on the host, every step (one read; the README says what it costs).
            self._stop_if_nonfinite()

    def _gradients(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model.parameters() if p.grad is not None]

    def _unscaled_in_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the gradients are still multiplied by the ``GradScaler``'s scale: under 16-mixed
        with an optimizer that unscales inside its own step (fused AdamW), which Lightning leaves
        the gradients scaled for (with any other, it unscales before ``on_before_optimizer_step``)."""
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        return scaler is not None and getattr(optimizer, "_step_supports_amp_scaling", False)

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: int | float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """``--trainer.gradient_clip_val``, on the device, for every precision, fused AdamW kept.

        Lightning's own clipping refuses fused optimizers under ``*-mixed`` precision (its
        ``MixedPrecision.clip_gradients`` raises, bf16 included). Here ``"norm"`` (the default)
        scales the gradients by ``min(1, clip_val / global_norm)`` with the norm the non-finite
        guard has already taken (``clip_grads_with_norm_``: one norm pass, no host read), and
        ``"value"`` clamps each gradient element to ``[-clip_val, clip_val]`` on the device. Under
        16-mixed with fused AdamW the gradients are still scaled by the ``GradScaler`` here, so the
        norm is divided by the scale (and the value bound multiplied by it): the clip applies to the
        true gradients.
        """
        if not gradient_clip_val:
            return
        grads = self._gradients()
        if not grads:
            return
        algorithm = GradClipAlgorithmType(gradient_clip_algorithm or GradClipAlgorithmType.NORM)
        scale = None
        if self._unscaled_in_step(optimizer):
            scale = self.trainer.precision_plugin.scaler._get_scale_async()  # a tensor; get_scale() reads it back
        norm = self._nonfinite.grad_norm
        if norm is None:  # 16-mixed: the guard leaves the gradients to the GradScaler
            norm = self._nonfinite.total_norm(grads)
            if scale is not None:
                norm = norm / scale
                # An infinite norm would zero (norm) or bound (value) the gradients and hide the
                # overflow from the GradScaler, which must skip this update and lower its scale.
                grads[0].masked_fill_(~torch.isfinite(norm), float("nan"))
        if algorithm == GradClipAlgorithmType.NORM:
            # x min(1, clip / (norm + 1e-6)); a non-finite norm keeps some gradient non-finite
            # (inf x 0 = nan), which the skip decided above already covers.
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), gradient_clip_val, norm)
        elif scale is None:
            torch.nn.utils.clip_grad_value_(self.model.parameters(), gradient_clip_val)
        else:
            bound = scale * gradient_clip_val
            for grad in grads:
                grad.clamp_(-bound, bound)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        step, every = self.global_step, self.trainer.log_every_n_steps
        if every > 0 and step % every == 0 and step != self._nonfinite_checked_at:
            self._stop_if_nonfinite()  # at each logging interval, where the logger reads values anyway
        # log_every_n_steps 0 (no step logging): checked before each checkpoint and at the end

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._stop_if_nonfinite()  # no checkpoint is written after a bad step

    def on_train_end(self) -> None:
        self._stop_if_nonfinite()

    def _stop_if_nonfinite(self) -> None:
        self._nonfinite_checked_at = self.global_step
        bad_step = self._nonfinite.first_bad_step()
        if bad_step is not None:
            raise UserError(
                f"train/loss or a gradient became non-finite (nan or inf) at step {bad_step}. That update "
                "and every one after it were skipped, and no checkpoint was written since, so the weights "
                "and the last checkpoint are those from before it. Lower model.learning_rate, add "
                "model.warmup_steps, or use bf16-mixed instead of 16-mixed."
            )

    def _eval_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        with self._evaluation_stance():
            loss = self._loss(batch)
        self.val_loss.update(loss, weight=batch[0].numel())

    def _evaluation_stance(self) -> ContextManager:
        """Eager unless ``compile_eval`` (and never in the sanity check): see ``gpt_lightning.compilation``."""
        sanity_checking = self._trainer is not None and self._trainer.sanity_checking
        return evaluation_stance(self.hparams.compile_eval, sanity_checking)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self._eval_step(batch)

    def _log_eval(self, prefix: str) -> None:
        loss = self.val_loss.compute()
        self.log(f"{prefix}/loss", loss, prog_bar=prefix == "val")
        self.log(f"{prefix}/perplexity", torch.exp(loss))
        self.val_loss.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_eval("val")
        if self.hparams.val_sample_tokens > 0 and not self.trainer.sanity_checking:
            with torch.compiler.set_stance("force_eager"):  # a new length each token: never compiled
                self._log_sample()

    def _log_sample(self) -> None:
        add_text = getattr(getattr(self.logger, "experiment", None), "add_text", None)
        if add_text is None:
            return
        # Every rank samples (the same tokens: same weights, same generator seed): under FSDP each
        # forward all-gathers the weights, a collective that every rank must join. Rank 0 logs.
        encoding = gpt2_encoding()
        prompt = encoding.encode_ordinary(self.hparams.val_sample_prompt) or [encoding.eot_token]
        idx = torch.tensor([prompt], dtype=torch.long, device=self.device)
        generator = torch.Generator(device=self.device).manual_seed(0)  # same draw every time: comparable
        out = self.model.generate(
            idx, self.hparams.val_sample_tokens, temperature=1.0, top_k=50, generator=generator, vocab_limit=encoding.n_vocab
        )
        if not self.trainer.is_global_zero:
            return
        text = encoding.decode(out[0].tolist())
        # Markdown would swallow line breaks: indent as a code block.
        add_text("samples", "    " + text.replace("\n", "\n    "), self.global_step)

    def on_test_epoch_end(self) -> None:
        self._log_eval("test")

    # --- optimization ----------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": hp.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(
            groups, lr=hp.learning_rate, betas=tuple(hp.betas), eps=hp.eps,
            # Fused: one kernel for all parameters. On CUDA the reference's choice; on CPU 7.6x faster
            # than the default per-parameter loop for the tiny-cpu model (3.8 ms vs 29 ms a step).
            fused=self.device.type in ("cuda", "cpu") or None,
        )
        if hp.warmup_steps == 0 and hp.cosine_decay_steps is None:
            return optimizer
        scheduler = LambdaLR(optimizer, self.lr_multiplier)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def lr_multiplier(self, step: int) -> float:
        """Learning rate at optimizer step ``step`` as a fraction of the peak."""
        hp = self.hparams
        if step < hp.warmup_steps:
            return (step + 1) / hp.warmup_steps
        if hp.cosine_decay_steps is None:
            return 1.0
        progress = min(1.0, (step - hp.warmup_steps) / hp.cosine_decay_steps)
        return hp.min_lr_ratio + (1 - hp.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
