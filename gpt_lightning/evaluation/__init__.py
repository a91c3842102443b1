"""Scoring a ``GPT`` on EleutherAI's lm-evaluation-harness tasks (the optional ``eval`` extra).

``harness_model.GPTHarnessLM`` is the harness's model API on our GPT; ``tasks.run_tasks`` runs the
harness's tasks on it. Nothing here imports ``lm_eval`` until one of those modules is imported.
"""
