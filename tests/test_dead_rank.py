"""The survivors of a rank that went away, in 2-process gloo jobs on the CPU: a rank that stops answering
ends the other at the timeout the user sets, in one line naming a file with the whole error (a killed
rank under torchrun --max-restarts: tests/test_ddp.py), at any moment of the fit. Real errors keep their
traceback. Ranks wait through a ``prepare_data`` longer than the timeout."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest
from conftest import TINY_FIT, tiny_flags
from lightning.pytorch import Callback
from test_cli import REPO
from test_ddp import ENV, fit_args

from gpt_lightning.lightning_cli import GPTLightningCLI


def test_the_survivor_of_a_rank_that_hangs_stops_at_the_timeout_given_in_one_line(small_text, tmp_path):
    stopped = tmp_path / "stopped.json"
    stop = {"class_path": "ddp_probe.StopRank", "init_args": {"rank": 1, "step": 3, "out": str(stopped)}}
    args = fit_args(small_text, tmp_path, max_steps=8)
    args[args.index("--trainer.strategy") + 1] = "DDPStrategy"
    # 30 s: rank 1 must also join the process group within it, after its start on a busy machine.
    args += [
        "--trainer.strategy.timeout",
        "0:00:30",
        "--trainer.devices",
        "2",
        f"--trainer.callbacks+={json.dumps(stop)}",
    ]
    with open(tmp_path / "stderr", "w") as stderr:  # rank 1 (stopped) keeps it open: not a pipe
        survivor = subprocess.Popen(
            [sys.executable, "-m", "gpt_lightning", *args],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env={**os.environ, "PYTHONPATH": str(REPO), **ENV},
        )
        try:
            returncode = survivor.wait(timeout=300)
            ended = time.time()
        finally:
            survivor.kill()
            if stopped.exists():
                os.kill(json.loads(stopped.read_text())["pid"], signal.SIGKILL)
    log = (tmp_path / "stderr").read_text()
    assert stopped.exists(), log[-3000:]  # rank 1 reached step 3 and stopped there
    waited = ended - json.loads(stopped.read_text())["time"]
    assert 25 < waited < 90, waited  # the 30 s given, not 10 or 30 minutes
    assert returncode == 1
    assert "Traceback" not in log, log[-3000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith("gpt-lightning: error: another rank of this run went away"), last
    assert "--ckpt_path last" in last
    error_file = tmp_path / "tb" / "tiny-cpu" / "version_0" / "error-rank0.txt"  # the run's log directory
    assert f"the whole error is in {error_file})" in last
    assert "Traceback" in error_file.read_text() and "Timed out waiting" in error_file.read_text()


def test_a_strategy_by_name_waits_10_minutes_and_a_timeout_given_wins(in_process_group):
    base = [
        "--config",
        str(REPO / "configs/tiny-cpu.yaml"),
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "2",
        "--trainer.logger",
        "false",
    ]
    for strategy, expected in (
        ([], timedelta(minutes=10)),  # auto, on 2 devices: ddp
        (["--trainer.strategy", "ddp"], timedelta(minutes=10)),
        (["--trainer.strategy", "DDPStrategy", "--trainer.strategy.timeout", "0:45:00"], timedelta(minutes=45)),
    ):
        cli = GPTLightningCLI(args=[*base, *strategy], run=False)
        assert type(cli.trainer.strategy).__name__ == "DDPStrategy"
        assert cli.trainer.strategy._timeout == expected, strategy  # what init_process_group gets


# What the collectives raise, in the shapes torch and gloo give them. A gone peer: gloo a moment after
# a rank was SIGKILLed (as measured), gloo at the timeout of a rank that hangs, NCCL's remote error.
GLOO_CLOSED = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:51911. "
    "This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error."
)
GLOO_TIMED_OUT = "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 30000ms for recv operation to complete"
NCCL = "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, {}, NCCL version 2.26.2\n{}\nLast error:\n{}"


def real_errors():
    """Errors of a broken run, not of a gone peer: each must keep its traceback."""
    import torch
    import torch.distributed as dist

    try:  # rank 0's store at startup, the other rank never joining: raised for real
        dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, timeout=timedelta(seconds=1), wait_for_workers=True)
    except dist.DistStoreError as err:
        startup = err
    return [
        dist.DistBackendError(
            NCCL.format(
                "invalid usage (run with NCCL_DEBUG=WARN for details)",
                "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.",
                "Invalid config blocking attribute value -2147483648",
            )
        ),
        dist.DistBackendError(
            NCCL.format(
                "unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
                "ncclUnhandledCudaError: Call to CUDA function failed.",
                "Cuda failure 2 'out of memory'",
            )
        ),
        torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 1.53 GiB. GPU 0 has a total capacity of 79.10 GiB of "
            "which 1.02 GiB is free. Of the allocated memory 75.20 GiB is allocated by PyTorch."
        ),
        startup,
        dist.DistNetworkError(
            "The server socket has failed to listen on any local network address. port: 29500, "
            "useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use"
        ),
        RuntimeError(
            "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:144] connect [127.0.1.1]:40523: Connection refused"
        ),
    ]


def test_real_errors_keep_their_traceback_even_after_training_started(tmp_path, monkeypatch):
    import torch.distributed as dist

    from gpt_lightning.stopping.dead_rank import PeerGoneReport, exit_if_peer_went_away, peer_went_away

    errors = real_errors()
    assert "1/2 clients joined" in str(errors[3])
    trainer = SimpleNamespace(log_dir=str(tmp_path), default_root_dir=str(tmp_path), global_rank=0)
    report = PeerGoneReport()
    report.setup(trainer, None, "fit")  # the fit set up: only what a gone peer raises is told in one line
    monkeypatch.setattr(os, "_exit", exit_now)
    for err in errors:
        assert not peer_went_away(err), err
        report.on_exception(trainer, None, err)
        exit_if_peer_went_away(err)  # returns: the CLI raises it again, with its traceback
    assert not list(tmp_path.iterdir())
    gone = [
        RuntimeError(GLOO_CLOSED),
        RuntimeError(GLOO_TIMED_OUT),
        dist.DistBackendError(
            NCCL.format(
                "remote process exited or there was a network error",
                "ncclRemoteError: A call failed possibly due to a network error or a remote "
                "process exiting prematurely.",
                "socketProgress: Connection closed by remote peer",
            )
        ),
    ]
    for err in gone:
        assert peer_went_away(err), err
        try:
            raise err
        except RuntimeError as raised:
            report.on_exception(trainer, None, raised)
            with pytest.raises(SystemExit, match="1"):
                exit_if_peer_went_away(raised)
        assert f"{type(err).__name__}: {str(err).splitlines()[0]}" in (tmp_path / "error-rank0.txt").read_text()
    # Before the fit's setup (a rank waiting at Lightning's first barrier for one that failed earlier, as under
    # torchrun), the log directory is not known yet: the trainer's root directory holds the file.
    early = SimpleNamespace(default_root_dir=str(tmp_path / "root"), global_rank=1)
    (tmp_path / "root").mkdir()
    try:
        raise RuntimeError(GLOO_CLOSED)
    except RuntimeError as raised:
        PeerGoneReport().on_exception(early, None, raised)
        with pytest.raises(SystemExit, match="1"):
            exit_if_peer_went_away(raised)
    assert "Connection closed by peer" in (tmp_path / "root" / "error-rank1.txt").read_text()


def exit_now(code):
    raise SystemExit(code)


class RaiseAt(Callback):
    """Raises gloo's error for a killed peer at train start (before the first step), as a collective would."""

    def on_train_start(self, trainer, pl_module):
        raise RuntimeError(GLOO_CLOSED)


def test_rank_1_sigkilled_in_the_first_step_of_a_launch_is_told_by_rank_0_in_one_line(small_text, tmp_path):
    """Rank 1 SIGKILLed after its first micro-batch of 2 (the out-of-memory killer), before any optimizer step:
    rank 0's all-reduce finds out first. Before, rank 0 printed gloo's traceback through the optimizer's closure
    (the fault mixture's seed 106069), and its line, where it had one, pointed at rank 1's empty log."""
    kill = {"class_path": "ddp_probe.KillRank", "init_args": {"rank": 1, "step": 0}}
    args = [
        *fit_args(small_text, tmp_path, max_steps=2),
        *["--trainer.devices", "2", "--data.tokens_per_step", "256"],  # 2 ranks x 2 x 32 tokens x 2 micro-batches
        f"--trainer.callbacks+={json.dumps(kill)}",
    ]
    started = subprocess.run(
        [sys.executable, "-m", "gpt_lightning", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **ENV},
    )
    assert started.returncode == 1, started.stderr[-3000:]
    assert "Traceback" not in started.stderr, started.stderr[-3000:]
    last = started.stderr.strip().splitlines()[-1]
    assert last.startswith("gpt-lightning: error: another rank of this run went away, and this one (rank 0"), last
    assert "stopped (RuntimeError: " in last, last
    (error_file,) = tmp_path.rglob("error-rank0.txt")
    assert f"the whole error is in {error_file}): SIGKILL is a signal from outside the run" in last, last
    assert "gloo/transport" in error_file.read_text()  # the whole traceback: closed, or reset, by the peer


class SignalledThenPeerGone(RaiseAt):
    """A group SIGTERM at startup: this rank, its fit set up, records it; the peer, not yet, died of it at once,
    which this rank's next collective finds out."""

    def on_train_start(self, trainer, pl_module):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)  # handled
        super().on_train_start(trainer, pl_module)


def test_a_gone_peer_after_a_stop_signal_stops_with_143_in_one_line(small_text, tmp_path, monkeypatch, capsys):
    """Before, this rank printed gloo's traceback and exited 1, where the signal asked for a stop (143)."""
    from gpt_lightning.cli import main

    monkeypatch.setattr(os, "_exit", exit_now)
    monkeypatch.chdir(tmp_path)
    args = fit_args(small_text, tmp_path, max_steps=2)
    args[args.index("--trainer.strategy") + 1] = "auto"
    probe = {"class_path": "test_dead_rank.SignalledThenPeerGone"}
    with pytest.raises(SystemExit) as stopped:
        main([*args, "--trainer.devices", "1", f"--trainer.callbacks+={json.dumps(probe)}"])
    assert stopped.value.code == 143
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("gpt-lightning: stopped by SIGTERM; another rank of this run went away meanwhile"), last


# Two ranks as a launcher starts them, joining together (so that the timeout can be short); local rank 0
# prepares the data for longer than the process group's timeout, as a large text's tokenizing does.
SLOW_PREPARE = """
import os, sys, time
from datetime import timedelta
from pathlib import Path
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import DDPStrategy
from gpt_lightning.data.datamodule import TokenStreamDataModule
from gpt_lightning.training.module import GPTLightningModule

TIMEOUT = 3

class SlowPrepare(TokenStreamDataModule):
    def prepare_data(self):
        time.sleep(TIMEOUT + 2)
        super().prepare_data()
        (out / "prepared").write_text(str(time.time()))

out, rank = Path(sys.argv[1]), int(os.environ["LOCAL_RANK"])
(out / f"ready{rank}").touch()
while not all((out / f"ready{r}").exists() for r in range(2)):
    time.sleep(0.05)
trainer = Trainer(accelerator="cpu", devices=2, strategy=DDPStrategy(timeout=timedelta(seconds=TIMEOUT)), max_steps=1,
                  limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)
model = GPTLightningModule(n_layer=1, n_head=2, n_embd=32, compile=False, block_size=32, val_sample_tokens=0)
trainer.fit(model, SlowPrepare(data_path=sys.argv[2], batch_size=2, block_size=32, cache_dir=str(out / "cache")))
(out / f"trained{rank}").write_text(str(trainer.global_step))
"""


def test_ranks_wait_for_the_data_to_be_prepared_longer_than_the_timeout(small_text, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", SLOW_PREPARE, str(tmp_path), str(small_text)],
            cwd=tmp_path,
            env={
                **os.environ,
                **ENV,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "WORLD_SIZE": "2",
                "NODE_RANK": "0",
                "LOCAL_RANK": str(rank),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    logs = [rank.communicate(timeout=300)[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], logs[0][-2000:] + logs[1][-2000:]
    assert (tmp_path / "prepared").exists()  # rank 1 waited through it, past the 3 s timeout
    assert [(tmp_path / f"trained{r}").read_text() for r in range(2)] == ["1", "1"]


def test_when_lightning_s_launcher_notices_first_rank_0_still_says_it_in_one_line(small_text, tmp_path):
    """Rank 1 SIGKILLed while both ranks wait in Python between steps, in no collective: only the
    launcher's watcher (polling every 5 s) can notice. Before, it SIGKILLed rank 0 (exit 137) with
    Lightning's "Forcefully terminating all other processes" and no line of ours."""
    hold = {"class_path": "preemption_probe.HoldAt", "init_args": {"out_dir": str(tmp_path / "hold"), "moment": "step"}}
    args = [
        *fit_args(small_text, tmp_path, max_steps=4),
        "--trainer.devices",
        "2",
        f"--trainer.callbacks+={json.dumps(hold)}",
    ]
    started = subprocess.Popen(
        [sys.executable, "-m", "gpt_lightning", *args],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **ENV, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])},
        start_new_session=True,
    )
    marks = [tmp_path / "hold" / f"step-rank{rank}" for rank in range(2)]
    deadline = time.monotonic() + 300
    try:
        while not all(mark.exists() for mark in marks) and started.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        rank1 = int(marks[1].read_text())
        os.kill(rank1, signal.SIGKILL)
        err = started.communicate(timeout=60)[1]
    finally:
        os.killpg(started.pid, signal.SIGKILL) if started.poll() is None else None
    assert started.returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        "gpt-lightning: error: another rank of this run went away, and this one (rank 0 of 2) stopped "
        f"(Lightning's launcher saw rank 1 (pid {rank1}) end: killed by SIGKILL): "
    ), last
    assert "--ckpt_path last" in last


def test_a_second_run_in_one_process_still_says_a_launched_rank_ended_and_lightning_s_own_watcher_is_back(
    small_text, tmp_path
):
    """``main()`` twice in one process (a notebook). Before, the first run left Lightning's launcher watcher
    replaced and the end claimed: a later DDP launch (a plain ``Trainer``'s or the CLI's) got neither
    Lightning's kill of the other ranks nor our line."""
    args = [
        *TINY_FIT,
        *tiny_flags(
            {
                "data.data_path": small_text,
                "data.cache_dir": tmp_path / "cache",
                "data.block_size": 32,
                "trainer.max_steps": 1,
                "trainer.logger.init_args.save_dir": tmp_path / "tb",
            }
        ),
    ]
    killed = {"class_path": "ddp_probe.LaunchedRankKilled"}
    body = f"""
import subprocess
from lightning.fabric.strategies.launchers import subprocess_script
from gpt_lightning.cli import main
lightnings = subprocess_script._ChildProcessObserver
main({args!r})
killed, live, launcher = subprocess.Popen(["sh", "-c", "kill -9 $$"]), subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
killed.wait()
subprocess_script._ChildProcessObserver(main_pid=launcher.pid, child_processes=[killed, live])._run()
def ended(proc):
    try:
        return proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "running"
print("watcher:", subprocess_script._ChildProcessObserver is lightnings, ended(live), ended(launcher), flush=True)
main({[*args, "--trainer.callbacks+=" + json.dumps(killed)]!r})
"""
    result = subprocess.run(
        [sys.executable, "-c", body],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **ENV},
    )
    assert "watcher: True -9 -9\n" in result.stdout, result.stdout[-500:] + result.stderr[-3000:]  # Lightning's kill
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "gpt-lightning: error: another rank of this run went away, and this one (rank 0) stopped "
        "(Lightning's launcher saw rank 1 (pid "
    ), last
