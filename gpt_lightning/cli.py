"""The ``gpt-lightning`` command: Lightning's CLI for fit / validate / test, and our own
``bench`` (eager vs compiled), ``sample`` (text from a checkpoint), ``export`` (plain weights) and
``tokenize`` (text folder to shards). User mistakes end with one line on stderr and exit code 2."""

from __future__ import annotations

import importlib
import sys

from gpt_lightning.errors import UserError
from gpt_lightning.scaling.launched_ranks import StoppedOutsideTraining, cli_run, wait_for_launched_ranks

# Our own commands, each a module of gpt_lightning.commands with a main(argv); imported on use.
COMMANDS = {
    "bench": "train one config eager, then compiled, and compare throughput and loss",
    "sample": "continue a prompt with a checkpoint",
    "export": "write a checkpoint's GPT weights to safetensors or a Hugging Face folder",
    "tokenize": "turn .txt, .jsonl or .parquet files into GPT-2 token shards",
    "eval": "score a checkpoint or a Hugging Face GPT-2 on lm-evaluation-harness tasks, or on HellaSwag",
}
OVERVIEW = "\n".join(
    [
        "usage: gpt-lightning COMMAND [options]",
        "",
        "Lightning's commands, configured by YAML files and flags (COMMAND --help lists every option):",
        "  fit, validate, test",
        "Ours (COMMAND --help for their options):",
        *(f"  {name:<9} {text}" for name, text in COMMANDS.items()),
    ]
)


def _lightning_errors() -> tuple[type[Exception], ...]:
    """Lightning's configuration error, once Lightning is loaded (``tokenize`` never loads it)."""
    if "lightning" not in sys.modules:
        return ()
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    return (MisconfigurationException,)


def main(args: list[str] | None = None) -> None:
    """Entry point of ``gpt-lightning`` and ``python -m gpt_lightning``. Called from Python (a notebook),
    it returns, or raises ``SystemExit``: code 2 for a user's mistake, 143 / 130 for a SIGTERM / Ctrl-C
    (``Preempted`` in training, ``StoppedOutsideTraining`` outside it), never ``KeyboardInterrupt``
    but for a second Ctrl-C in training."""
    with cli_run():  # first: a rank Lightning's launcher started never outlives it
        _main(args)


def _main(args: list[str] | None) -> None:
    argv = sys.argv[1:] if args is None else args
    if not argv or argv[0] in ("-h", "--help"):
        print(OVERVIEW, file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    try:
        if argv[0] in COMMANDS:
            importlib.import_module(f"gpt_lightning.commands.{argv[0]}").main(argv[1:])
        else:
            from gpt_lightning.lightning_cli import GPTLightningCLI
            from gpt_lightning.scaling.dead_rank import report_launched_rank_ends

            with report_launched_rank_ends():
                GPTLightningCLI(args=args)
                wait_for_launched_ranks()
    except SystemExit as stop:
        if stop.code in (130, 143) and not isinstance(stop, StoppedOutsideTraining):  # every rank at one step
            wait_for_launched_ranks()
        raise
    except (UserError, *_lightning_errors()) as err:  # evaluated only when something was raised
        print(f"gpt-lightning: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except RuntimeError as err:  # a collective failed: another rank may have gone away
        from gpt_lightning.scaling.dead_rank import exit_if_peer_went_away

        exit_if_peer_went_away(err)  # one line and exit 1 for a peer gone after training started
        raise
    except OSError as err:
        # A path that cannot be read or written (a file where a folder should be, no permission):
        # the system's words and the path, one line. Anything else keeps its traceback.
        if err.filename is None or isinstance(err, (ConnectionError, TimeoutError)):
            raise
        print(f"gpt-lightning: error: {err}. Check the paths given.", file=sys.stderr)
        raise SystemExit(2) from None
