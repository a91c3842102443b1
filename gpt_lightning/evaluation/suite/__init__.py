"""Task groups shipped as lm-evaluation-harness YAMLs in this folder (``gpt2-suite``), found through
``SUITE_DIR`` on the harness's include path."""

from pathlib import Path

SUITE_DIR = Path(__file__).resolve().parent
