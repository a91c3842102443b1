"""Callbacks the preemption tests attach through the CLI. ``MicroBatchLog``: each rank appends
``global_step batch_idx pid`` to a file as every micro-batch starts (the test signals the process when
it sees a chosen one), then waits a little, so that the signal lands inside that micro-batch; the
sanity check's batches likewise, to ``rank{N}-sanity.log``. ``HoldAt``: each rank waits at a chosen
moment of the fit until the test lets it go, and records how the fit ended."""

import os
import time
from pathlib import Path

from lightning.pytorch import Callback


class MicroBatchLog(Callback):
    def __init__(self, out_dir: str, pause: float = 0.2) -> None:
        self.out_dir = Path(out_dir)
        self.pause = pause

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with open(self.out_dir / f"rank{trainer.global_rank}.log", "a") as f:
            f.write(f"{trainer.global_step} {batch_idx} {os.getpid()}\n")
        time.sleep(self.pause)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if trainer.sanity_checking:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with open(self.out_dir / f"rank{trainer.global_rank}-sanity.log", "a") as f:
                f.write(f"{batch_idx} {os.getpid()}\n")
            time.sleep(self.pause)


class HoldAt(Callback):
    """At ``moment`` (``restore``: the checkpoint's restore; ``sanity``: the sanity check's first
    batch; ``train_start``: its ``on_train_start``, before ``Preemption``'s; ``step``: the second optimizer step's
    first micro-batch) each rank writes its pid to
    ``out_dir/{moment}-rank{N}`` and waits until ``out_dir/go``
    exists, so that a signal sent meanwhile lands there. ``exit-rank{N}`` records the exception the
    fit ended with and its exit code."""

    def __init__(self, out_dir: str, moment: str) -> None:
        self.out_dir = Path(out_dir)
        self.moment = moment

    def _hold(self, trainer) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        mark = self.out_dir / f"{self.moment}-rank{trainer.global_rank}"
        mark.with_suffix(".tmp").write_text(str(os.getpid()))
        mark.with_suffix(".tmp").replace(mark)  # whole when it appears: the test reads it at once
        deadline = time.monotonic() + 120
        while not (self.out_dir / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.02)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint):
        if self.moment == "restore":
            self._hold(trainer)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if self.moment == "sanity" and trainer.sanity_checking and batch_idx == 0:
            self._hold(trainer)

    def on_train_start(self, trainer, pl_module):
        if self.moment == "train_start":
            self._hold(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.moment == "step" and trainer.global_step == 1:
            self._hold(trainer)

    def on_exception(self, trainer, pl_module, exception):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = f"{type(exception).__name__} {getattr(exception, 'code', None)}"
        (self.out_dir / f"exit-rank{trainer.global_rank}").write_text(record)


class NoGlooInterface(Callback):
    """Names a network interface that does not exist for gloo once the run's own process group is
    up: the next gloo group (``Preemption``'s) cannot be formed, as on a host whose name resolves to
    no address the other nodes reach."""

    def setup(self, trainer, pl_module, stage):
        os.environ["GLOO_SOCKET_IFNAME"] = "nonexistent0"


class ForkPool(Callback):
    """A user's pool, as a library forks one (``datasets.map(num_proc=2)``): a ``fork`` ``Pool(2)`` in the fit's
    ``setup`` (before ``Preemption`` listens) and again at the first step (its handler in place), each left by its
    ``with`` while its workers are busy, which SIGTERMs them (``Pool.terminate``)."""

    def _pool(self) -> None:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(2) as pool:
            assert pool.map(abs, [-1, -2, -3]) == [1, 2, 3]
            pool.map_async(time.sleep, [60, 60])
            time.sleep(0.5)  # both workers asleep in their task

    def setup(self, trainer, pl_module, stage):
        self._pool()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            self._pool()


class SlowInit(Callback):
    """A user's callback whose ``__init__`` spends ``seconds`` in one C call (a store's wait; a tokenizer's or a
    big ``torch.load`` alike), with a Ctrl-C to this process ``ctrl_c_after`` seconds into it."""

    def __init__(self, seconds: float = 4.5, ctrl_c_after: float = 0.3) -> None:
        import signal
        import threading
        from datetime import timedelta

        import torch.distributed as dist

        threading.Timer(ctrl_c_after, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=seconds), wait_for_workers=True)
        except dist.DistStoreError:  # no other rank joins: the call returns at its timeout
            pass


class CtrlCAtSetup(Callback):
    """A Ctrl-C to this process inside the fit, before ``Preemption`` listens (as in ``prepare_data``)."""

    def setup(self, trainer, pl_module, stage):
        import signal

        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
