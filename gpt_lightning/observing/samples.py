"""``ValidationSamples``: text sampled from the model after each validation, to watch it learn to write."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from gpt_lightning.averaging import averaged_weights
from gpt_lightning.data.tokenizer import gpt2_encoding
from gpt_lightning.errors import UserError
from gpt_lightning.generation import generate
from gpt_lightning.model import GPT

TAG = "samples"
FILENAME = "samples.txt"


class ValidationSamples(Callback):
    """Text sampled after each validation under ``samples``, at the step of ``val/*``: same seed, the run's
    precision, the weights validated. Each logger that takes text (TensorBoard, W&B, MLflow) gets it;
    with none, ``samples.txt`` in ``trainer.log_dir``. For any module whose ``model`` is a ``GPT``.

    Args:
        tokens: tokens to sample; 0 turns the samples off. None: the module's ``val_sample_tokens``.
        prompt: the text to continue. None: the module's ``val_sample_prompt``, else the end-of-text token.
    """

    def __init__(self, tokens: int | None = None, prompt: str | None = None) -> None:
        if tokens is not None and tokens < 0:
            raise UserError(f"ValidationSamples(tokens=...) must be >= 0, got {tokens}.")
        self.tokens = tokens
        self.prompt = prompt
        self._writers: list[Callable[[str, int], None]] | None = None  # at the first validation

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not isinstance(getattr(pl_module, "model", None), GPT):
            raise UserError(
                f"ValidationSamples samples from the module's GPT (module.model generates with gpt_lightning.generation); "
                f"{type(pl_module).__name__} has none. Remove the callback or give the module a gpt_lightning GPT as .model."
            )
        if self._setting(pl_module, "tokens") is None:
            raise UserError(
                f"ValidationSamples needs tokens=N: {type(pl_module).__name__} has no val_sample_tokens hyper-parameter."
            )

    def _setting(self, pl_module: LightningModule, name: str) -> int | str | None:
        own = getattr(self, name)
        return own if own is not None else pl_module.hparams.get(f"val_sample_{name}")

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        tokens = self._setting(pl_module, "tokens")
        if not tokens or trainer.sanity_checking:
            return
        if self._writers is None:
            self._writers = text_writers(trainer)  # every rank: trainer.log_dir is a collective
        # As validation runs: the averaged weights where kept, the run's precision.
        with (
            averaged_weights(trainer, pl_module, self, "on_validation_epoch_end"),
            torch.compiler.set_stance("force_eager"),
            trainer.precision_plugin.forward_context(),
        ):
            text = self.sample(pl_module, tokens, self._setting(pl_module, "prompt") or "")
        if trainer.is_global_zero:
            for write in self._writers:
                write(text, trainer.global_step)

    @staticmethod
    def sample(pl_module: LightningModule, tokens: int, prompt: str) -> str:
        """``prompt`` and ``tokens`` sampled tokens after it (temperature 1, top-k 50, seed 0), as text.
        Every rank samples: under FSDP each forward is a collective."""
        encoding = gpt2_encoding()
        ids = encoding.encode_ordinary(prompt) or [encoding.eot_token]
        idx = torch.tensor([ids], dtype=torch.long, device=pl_module.device)  # (1, T)
        generator = torch.Generator(device=pl_module.device).manual_seed(0)
        out = generate(
            pl_module.model, idx, tokens, temperature=1.0, top_k=50, generator=generator, vocab_limit=encoding.n_vocab
        )
        return encoding.decode(out[0].tolist())


def text_writers(trainer: Trainer) -> list[Callable[[str, int], None]]:
    """A ``write(text, step)`` for each logger that takes text, else one appending to ``samples.txt``.
    Call on every rank."""
    writers = [w for w in map(_logger_text_writer, trainer.loggers) if w is not None]
    if writers:
        return writers
    path = Path(trainer.log_dir or trainer.default_root_dir) / FILENAME
    names = ", ".join(type(logger).__name__ for logger in trainer.loggers)
    rank_zero_info(f"Validation samples: {f'{names} takes no text' if names else 'no logger'}; they go to {path}.")

    def append(text: str, step: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(f"--- step {step} ---\n{text}\n\n")

    return [append]


def _logger_text_writer(logger: Logger) -> Callable[[str, int], None] | None:
    experiment: Any = logger.experiment
    add_text = getattr(experiment, "add_text", None)  # TensorBoard's SummaryWriter
    if callable(add_text):
        # Markdown would swallow line breaks: indent as a code block.
        return lambda text, step: add_text(TAG, "    " + text.replace("\n", "\n    "), step)
    log_text = getattr(logger, "log_text", None)  # WandbLogger: a table of (step, text)
    if callable(log_text):
        return lambda text, step: log_text(TAG, columns=["step", "text"], data=[[step, text]], step=step)
    run_id = getattr(logger, "run_id", None)  # MLFlowLogger: an MlflowClient, a text artifact per validation
    client_log_text = getattr(experiment, "log_text", None)
    if run_id is not None and callable(client_log_text):
        return lambda text, step: client_log_text(run_id, text, f"{TAG}/step-{step:07d}.txt")
    return None
