"""Observing a run: callbacks that measure and show, and change nothing that is trained.

- ``throughput``: ``ThroughputMonitor``, post-warm-up tokens/s, step time and MFU;
- ``console``: ``StepProgressBar`` (optimizer steps) and ``TrainingFlopsSummary`` (the model
  summary with training FLOPs and a memory estimate);
- ``samples``: ``ValidationSamples``, text sampled after each validation, logged to TensorBoard.

Each works with a plain ``Trainer``; the ``gpt-lightning`` CLI attaches all of them.
"""
