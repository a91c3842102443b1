"""``ValidationSamples``: after each validation, text sampled from the model, logged to TensorBoard,
so you can watch the model learn to write."""

from __future__ import annotations

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from gpt_lightning.data.tokenizer import gpt2_encoding
from gpt_lightning.errors import UserError
from gpt_lightning.generation import generate
from gpt_lightning.model import GPT

TAG = "samples"


class ValidationSamples(Callback):
    """Text sampled after each validation (not the sanity check), logged with the logger's ``add_text``
    under ``samples``: same seed every time, in the run's precision. Works with any module whose
    ``model`` is a gpt-lightning ``GPT``.

    Args:
        tokens: tokens to sample; 0 turns the samples off. None: the module's ``val_sample_tokens``
            hyper-parameter (``GPTLightningModule``'s, ``--model.val_sample_tokens`` on the CLI).
        prompt: the text to continue. None: the module's ``val_sample_prompt`` hyper-parameter, else
            the end-of-text token (a sample from nothing).
    """

    def __init__(self, tokens: int | None = None, prompt: str | None = None) -> None:
        if tokens is not None and tokens < 0:
            raise UserError(f"ValidationSamples(tokens=...) must be >= 0, got {tokens}.")
        self.tokens = tokens
        self.prompt = prompt

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
        """The callback's own value, else the module's ``val_sample_<name>`` hyper-parameter."""
        own = getattr(self, name)
        return own if own is not None else pl_module.hparams.get(f"val_sample_{name}")

    def on_validation_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        tokens = self._setting(pl_module, "tokens")
        if not tokens or trainer.sanity_checking:
            return
        add_text = getattr(getattr(trainer.logger, "experiment", None), "add_text", None)
        if add_text is None:
            return
        # In the run's precision, as validation itself (bf16 autocast under bf16-mixed): what the
        # model computes in training, at the speed of a bf16 GPU; float32 only when the run is.
        with torch.compiler.set_stance("force_eager"), trainer.precision_plugin.forward_context():
            text = self.sample(pl_module, tokens, self._setting(pl_module, "prompt") or "")
        if trainer.is_global_zero:
            # Markdown would swallow line breaks: indent as a code block.
            add_text(TAG, "    " + text.replace("\n", "\n    "), trainer.global_step)

    @staticmethod
    def sample(pl_module: LightningModule, tokens: int, prompt: str) -> str:
        """``prompt`` and ``tokens`` sampled tokens after it (temperature 1, top-k 50, seed 0), as text.
        Every rank samples: under FSDP each forward is a collective."""
        encoding = gpt2_encoding()
        ids = encoding.encode_ordinary(prompt) or [encoding.eot_token]
        idx = torch.tensor([ids], dtype=torch.long, device=pl_module.device)  # (1, T)
        generator = torch.Generator(device=pl_module.device).manual_seed(0)  # same draw every time: comparable
        out = generate(
            pl_module.model, idx, tokens, temperature=1.0, top_k=50, generator=generator, vocab_limit=encoding.n_vocab
        )
        return encoding.decode(out[0].tolist())
