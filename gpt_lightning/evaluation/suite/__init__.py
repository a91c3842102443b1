"""lm-evaluation-harness task groups shipped in this folder (``gpt2-suite``), on the include path."""

from pathlib import Path

SUITE_DIR = Path(__file__).resolve().parent
