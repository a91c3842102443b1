"""The ``gpt-lightning`` command: Lightning's CLI for fit / validate / test, and our own
``bench`` (eager vs compiled), ``sample`` (text from a checkpoint), ``export`` (plain weights) and
``tokenize`` (text folder to shards). User mistakes end with one line on stderr and exit code 2."""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from gpt_lightning.atomic import NO_ROOM_ERRNOS
from gpt_lightning.errors import UserError
from gpt_lightning.stopping.launched_ranks import LAUNCHER_PID, LaunchedRanks, die_with_launcher

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
    """Lightning's configuration error, where its module is loaded: only then can one be raised."""
    exceptions = sys.modules.get("lightning.fabric.utilities.exceptions")
    return (exceptions.MisconfigurationException,) if exceptions else ()


def _full_disk_said_once(hook: Callable[[Any], None], args: Any) -> None:
    """``threading.excepthook`` while the command runs: TensorBoard's writer thread, which keeps the error that ended
    it (``exception``) for the main thread's next write to raise, dies quietly on a full disk; that write says it."""
    told_later = getattr(args.thread, "exception", None) is args.exc_value
    if not (told_later and isinstance(args.exc_value, OSError) and args.exc_value.errno in NO_ROOM_ERRNOS):
        hook(args)


@contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """A Ctrl-C during the imports (seconds of torch and Lightning) raised only once they end: raised inside one,
    it leaves modules half made, and the next import of them fails with a traceback of its own. A second Ctrl-C
    raises at once. Only where Ctrl-C raises KeyboardInterrupt (Python's default, in the main thread)."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    received: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if received:
            raise KeyboardInterrupt
        received.append(signum)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if received:
        raise KeyboardInterrupt


def main(args: list[str] | None = None) -> None:
    """Entry point of ``gpt-lightning`` and ``python -m gpt_lightning``. Called from Python it returns or
    raises ``SystemExit`` (2: a user's mistake; 143 / 130: SIGTERM / Ctrl-C), never ``KeyboardInterrupt``;
    the caller's signal handlers are restored (docs/resume.md, "How a run stops")."""
    argv = sys.argv[1:] if args is None else args
    launcher, handlers = os.environ.get(LAUNCHER_PID), {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    die_with_launcher()  # first: a rank Lightning's launcher started never outlives it
    thread_hook = threading.excepthook
    threading.excepthook = partial(_full_disk_said_once, thread_hook)
    try:
        _main(argv, args)
    except (KeyboardInterrupt, SystemExit) as stop:
        # Lightning ends a fit it sees a KeyboardInterrupt in with sys.exit(1), in the ``except`` that caught it.
        if isinstance(stop, SystemExit) and not (stop.code == 1 and isinstance(stop.__context__, KeyboardInterrupt)):
            raise
        fit = ". Run the same command with --ckpt_path last to resume from the last checkpoint saved, if any"
        print(f"gpt-lightning: stopped by Ctrl-C (SIGINT){fit if argv[:1] == ['fit'] else ''}.", file=sys.stderr)
        raise SystemExit(130) from None
    finally:  # a caller (a notebook) goes on as before: Lightning leaves Ctrl-C ignored after one in its fit
        threading.excepthook = thread_hook
        for signum, handler in handlers.items():
            if signal.getsignal(signum) is not handler and handler is not None:
                signal.signal(signum, handler)
        if launcher is None:
            os.environ.pop(LAUNCHER_PID, None)
        else:
            os.environ[LAUNCHER_PID] = launcher


def _main(argv: list[str], args: list[str] | None) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        print(OVERVIEW, file=sys.stdout if argv else sys.stderr)
        raise SystemExit(0 if argv else 2)
    try:
        if argv[0] in COMMANDS:
            with _ctrl_c_held():
                command = importlib.import_module(f"gpt_lightning.commands.{argv[0]}")
            command.main(argv[1:])
        else:
            with _ctrl_c_held():
                from gpt_lightning.lightning_cli import GPTLightningCLI
                from gpt_lightning.lightning_internals import watch_launched_ranks
                from gpt_lightning.stopping.preemption import Preempted

            ranks = LaunchedRanks()
            with watch_launched_ranks(ranks.started, ranks.ended):
                try:
                    GPTLightningCLI(args=args)
                except Preempted as stop:  # every rank stopped at one step, and ends as this one does
                    ranks.finish(stop.code)
                    raise
                if ranks.finish(0):
                    raise SystemExit(1)
    except (UserError, *_lightning_errors()) as err:  # evaluated only when something was raised
        print(f"gpt-lightning: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except RuntimeError as err:  # a collective failed: another rank may have gone away
        from gpt_lightning.stopping.dead_rank import exit_if_peer_went_away

        exit_if_peer_went_away(err)  # one line and exit 1 for a peer gone after training started
        raise
    except OSError as err:
        if err.errno in NO_ROOM_ERRNOS:  # the logs', the token cache's, a command's output (a save says its own)
            where = f" ({err.filename})" if err.filename else ""
            then = ", then run the same command with --ckpt_path last to resume" if argv[0] == "fit" else ""
            print(f"gpt-lightning: error: {err.strerror}{where}. Free some space on that disk{then}.", file=sys.stderr)
            raise SystemExit(2) from None
        # A path that cannot be read or written: the system's words and the path, one line.
        if err.filename is None or isinstance(err, (ConnectionError, TimeoutError)):
            raise
        print(f"gpt-lightning: error: {err}. Check the paths given.", file=sys.stderr)
        raise SystemExit(2) from None
