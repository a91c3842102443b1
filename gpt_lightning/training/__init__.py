"""Training: the ``LightningModule`` and what it needs while it trains.

- ``module``: ``GPTLightningModule``, the GPT with AdamW, its learning-rate schedule, the steps and
  ``torch.compile``; each concern below is called from one-line hooks there;
- ``architecture``: the GPT built from the module's options, or from a Hugging Face GPT-2 (``init_from``);
- ``checks``: the options' ranges, and the data against the model's tables;
- ``resume``: what a resumed run checks and re-applies (same architecture; the optimizer settings
  given now);
- ``step_loss``: ``train/loss`` once per optimizer step, with no host read on the others;
- ``nonfinite``: ``NonFiniteGuard``, which keeps a nan or inf from updating the weights, and the
  gradient clipping that reuses its norm;
- ``compilation``: compiling in place, and when ``torch.compile`` compiles (training) and when it
  does not (evaluation).
"""
