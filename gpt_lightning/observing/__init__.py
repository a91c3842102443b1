"""Observing a run: callbacks that measure and show and change nothing trained; each works with a plain
``Trainer``, and the CLI attaches all of them."""
