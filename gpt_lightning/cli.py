"""The ``gpt-lightning`` command: Lightning's CLI for fit / validate / test, and our own
``bench`` (eager vs compiled), ``sample`` (text from a checkpoint), ``export`` (plain weights) and
``tokenize`` (text folder to shards). User mistakes end with one line on stderr and exit code 2."""

from __future__ import annotations

import importlib
import os
import sys

from gpt_lightning.errors import UserError

# Our own commands, each a module of gpt_lightning.commands with a main(argv); imported on use.
COMMANDS = {
    "bench": "train one config eager, then compiled, and compare throughput and loss",
    "sample": "continue a prompt with a checkpoint",
    "export": "write a checkpoint's GPT weights to safetensors or a Hugging Face folder",
    "tokenize": "turn .txt, .jsonl or .parquet files into GPT-2 token shards",
    "eval": "score a checkpoint or a Hugging Face GPT-2 on lm-evaluation-harness tasks, or on HellaSwag",
}
OVERVIEW = "\n".join([
    "usage: gpt-lightning COMMAND [options]",
    "",
    "Lightning's commands, configured by YAML files and flags (COMMAND --help lists every option):",
    "  fit, validate, test",
    "Ours (COMMAND --help for their options):",
    *(f"  {name:<9} {text}" for name, text in COMMANDS.items()),
])


def _lightning_errors() -> tuple[type[Exception], ...]:
    """Lightning's configuration error, once Lightning is loaded (``tokenize`` never loads it)."""
    if "lightning" not in sys.modules:
        return ()
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    return (MisconfigurationException,)


def main(args: list[str] | None = None) -> None:
    """Entry point of ``gpt-lightning`` and ``python -m gpt_lightning``."""
    argv = sys.argv[1:] if args is None else args
    if not argv or argv[0] in ("-h", "--help"):
        print(OVERVIEW, file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    try:
        if argv[0] in COMMANDS:
            importlib.import_module(f"gpt_lightning.commands.{argv[0]}").main(argv[1:])
        else:
            from gpt_lightning.lightning_cli import GPTLightningCLI

            GPTLightningCLI(args=args)
    except (UserError, *_lightning_errors()) as err:  # evaluated only when something was raised
        print(f"gpt-lightning: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except RuntimeError as err:  # a collective failed: another rank may have gone away
        from gpt_lightning.scaling.dead_rank import peer_went_away, went_away_message

        if not peer_went_away(err):
            raise
        print(f"gpt-lightning: error: {went_away_message(err)}", file=sys.stderr, flush=True)
        # Not SystemExit: at exit the process groups' destructors join threads still waiting on the
        # rank that went away (a gloo group's for up to its 30-minute timeout), and Lightning's
        # atexit destroys NCCL's. Lightning's teardown has run; nothing is left to save.
        sys.stdout.flush()
        os._exit(1)
    except OSError as err:
        # A path that cannot be read or written (a file where a folder should be, no permission):
        # the system's words and the path, one line. Anything else keeps its traceback.
        if err.filename is None or isinstance(err, (ConnectionError, TimeoutError)):
            raise
        print(f"gpt-lightning: error: {err}. Check the paths given.", file=sys.stderr)
        raise SystemExit(2) from None
