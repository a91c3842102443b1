"""Training: ``GPTLightningModule`` (``module``) and what its one-line hooks call: ``architecture``,
``checks``, ``resume``, ``step_loss``, ``nonfinite``, ``compilation``, ``optimizers``,
``preemption``, ``checkpoint_io``."""
