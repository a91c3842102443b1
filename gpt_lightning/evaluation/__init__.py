"""Scoring a ``GPT`` on lm-evaluation-harness tasks (the ``eval`` extra): ``harness_model.GPTHarnessLM``
and ``tasks.run_tasks``. Nothing here imports ``lm_eval`` until one of those modules is imported.
"""
