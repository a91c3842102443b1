"""Callbacks that measure and show a run and change nothing trained; each works with a plain ``Trainer``."""
