"""Scoring a ``GPT`` on lm-evaluation-harness tasks (the ``eval`` extra); ``lm_eval`` is imported on use."""
