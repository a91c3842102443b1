"""Helpers of the two-process tests: a callback each rank uses to write what it saw to a JSON file
(and the weights it ended at), and the checks that the ranks trained one job."""

import json
import statistics
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gpt_lightning.observing.throughput import ThroughputMonitor


class RecordRank(Callback):
    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.windows: list[list[int]] = []
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.windows.append(batch[0].tolist())  # (B, T) token ids of the window
        self.losses.append(float(outputs["loss"]))  # this rank's own loss

    def on_train_end(self, trainer, pl_module):
        monitor = next(cb for cb in trainer.callbacks if isinstance(cb, ThroughputMonitor))
        measured = [s for s in monitor.steps if s.index >= monitor.warmup_steps]
        record = {
            "rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "windows": self.windows,
            "losses": self.losses,
            "local_median_tokens_per_sec": statistics.median(s.tokens / s.seconds for s in measured),
            "weights_checksum": sum(float(p.double().sum()) for p in pl_module.parameters()),  # equal on every rank
            "optimizer": type(trainer.optimizers[0]).__name__,
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))
        torch.save(pl_module.state_dict(), self.out_dir / f"rank{trainer.global_rank}.pt")  # the weights it ended at


def check_one_job_on_two_ranks(tmp_path: Path, steps: int, logged_steps: list[int]) -> None:
    """What a 2-rank job of ``steps`` steps, logging at ``logged_steps``, must show: disjoint
    windows, one TensorBoard run, the loss logged as the mean over ranks and tokens/s as their sum.
    Shared by the DDP and the two-node torchrun tests."""
    ranks = [json.loads((tmp_path / "ranks" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]

    # Disjoint windows: rank r reads batches r, r+2, ... of the stream.
    seen = [{tuple(row) for window in r["windows"] for row in window} for r in ranks]
    assert len(ranks[0]["windows"]) == len(ranks[1]["windows"]) == steps
    assert not seen[0] & seen[1]

    (run_dir,) = (tmp_path / "tb" / "tiny-cpu").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    # The logged loss is the mean over both ranks, not rank 0's own, at every step it is written.
    logged = {e.step: e.value for e in events.Scalars("train/loss")}
    assert sorted(logged) == logged_steps
    values = [logged[step] for step in logged_steps]
    assert values == pytest.approx(
        [(ranks[0]["losses"][s] + ranks[1]["losses"][s]) / 2 for s in logged_steps], rel=1e-5
    )
    assert values != pytest.approx([ranks[0]["losses"][s] for s in logged_steps], rel=1e-5)

    # Tokens/sec is the sum of what each rank processed.
    summary = json.loads((run_dir / "throughput.json").read_text())
    assert summary["world_size"] == 2
    expected = sum(r["local_median_tokens_per_sec"] for r in ranks)
    assert summary["tokens_per_sec_median"] == pytest.approx(expected, rel=1e-5)
    assert summary["tokens_per_optimizer_step"] == 2 * summary["tokens_per_step_per_device"]  # both ranks


class KillRank(Callback):
    """SIGKILLs global rank ``rank`` after optimizer step ``step`` (a dead node, an OOM kill), in a
    torchrun launch only in its first attempt (``TORCHELASTIC_RESTART_COUNT`` 0)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import os
        import signal

        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if trainer.global_rank == self.rank and trainer.global_step == self.step and first_attempt:
            os.kill(os.getpid(), signal.SIGKILL)


class LaunchedRankKilled(Callback):
    """As the fit starts, Lightning's launcher watcher (what a DDP launch now would build) sees a rank it
    started SIGKILLed: a launch in one process, without a second process to start."""

    def on_train_start(self, trainer, pl_module):
        import os
        import subprocess

        from lightning.fabric.strategies.launchers import subprocess_script

        killed = subprocess.Popen(["sh", "-c", "kill -9 $$"])
        killed.wait()
        subprocess_script._ChildProcessObserver(main_pid=os.getpid(), child_processes=[killed])._run()


class StopRank(Callback):
    """SIGSTOPs global rank ``rank`` after optimizer step ``step`` (a rank that hangs: a deadlock, a
    stuck device), after writing its pid and the time to ``out``, for the test to kill it after."""

    def __init__(self, rank: int, step: int, out: str) -> None:
        self.rank, self.step, self.out = rank, step, out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        import os
        import signal
        import time

        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            Path(self.out).write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
            os.kill(os.getpid(), signal.SIGSTOP)


class RecordSteps(Callback):
    """Writes ``rank<r>.json`` to ``out_dir``: for each micro-batch this rank trained, the optimizer step
    it belongs to, the trainer's epoch then and the batch's rows (token ids); and the epoch at the end."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.batches: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append([trainer.global_step, trainer.current_epoch, batch[0].tolist()])

    def on_train_end(self, trainer, pl_module):
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {"batches": self.batches, "epoch": trainer.current_epoch, "world_size": trainer.world_size}
        (self.out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


class FailAfterRank0(Callback):
    """Rank 1 exits 3 a second after rank 0 has finished its fit (a crash in a rank's own last moments); each
    rank writes its pid to ``out_dir/rank<r>`` as its fit ends."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def teardown(self, trainer, pl_module, stage):
        import os
        import time

        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / f"rank{trainer.global_rank}").write_text(str(os.getpid()))
        if trainer.global_rank == 1:
            while not (self.out_dir / "rank0").exists():
                time.sleep(0.05)
            time.sleep(1)
            os._exit(3)
