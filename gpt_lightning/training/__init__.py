"""Training: ``GPTLightningModule`` (``module``) and what its one-line hooks call."""
