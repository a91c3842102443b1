"""Training: the ``LightningModule`` and what it needs while it trains.

- ``module``: ``GPTLightningModule``, the GPT with AdamW, its learning-rate schedule, the steps and
  ``torch.compile``;
- ``resume``: what a resumed run checks and re-applies (same architecture; the optimizer settings
  given now);
- ``nonfinite``: ``NonFiniteGuard``, which keeps a nan or inf from updating the weights, and the
  gradient clipping that reuses its norm;
- ``compilation``: when ``torch.compile`` compiles (training) and when it does not (evaluation).
"""
