"""Observing a run: callbacks that measure and show and change nothing trained (``ThroughputMonitor``,
``StepProgressBar``, ``TrainingFlopsSummary``, ``ValidationSamples``); each works with a plain
``Trainer``, and the ``gpt-lightning`` CLI attaches all of them."""
