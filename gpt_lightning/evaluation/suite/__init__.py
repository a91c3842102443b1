"""Task groups shipped with the package, as lm-evaluation-harness YAMLs in this folder:
``gpt2-suite`` (``gpt2-suite.yaml``), the tasks GPT-2-size models are compared on. The harness
finds them when this folder is on its include path (``SUITE_DIR``), as ``gpt-lightning eval`` and
``HarnessEval`` put it."""

from pathlib import Path

SUITE_DIR = Path(__file__).resolve().parent
