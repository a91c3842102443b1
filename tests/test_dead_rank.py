"""A rank that stops answering (a deadlock, a stuck device) in a 2-process gloo job on the CPU: the
survivor stops at the process group's timeout, which the user sets, with one line that says a rank
went away and how to resume. Without one, a strategy named on the command line (``ddp``, or ``auto``
on several devices) waits 10 minutes, not Lightning's 30. (A rank SIGKILLed, under torchrun with
--max-restarts: tests/test_ddp.py.)"""

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

from gpt_lightning.lightning_cli import GPTLightningCLI

from test_cli import REPO
from test_ddp import ENV, fit_args


def test_the_survivor_of_a_rank_that_hangs_stops_at_the_timeout_given_in_one_line(small_text, tmp_path):
    stopped = tmp_path / "stopped.json"
    stop = {"class_path": "ddp_probe.StopRank", "init_args": {"rank": 1, "step": 3, "out": str(stopped)}}
    args = fit_args(small_text, tmp_path, max_steps=8)
    args[args.index("--trainer.strategy") + 1] = "DDPStrategy"
    # 30 s: rank 1 must also join the process group within it, after its start on a busy machine.
    args += ["--trainer.strategy.timeout", "0:00:30", "--trainer.devices", "2", f"--trainer.callbacks+={json.dumps(stop)}"]
    with open(tmp_path / "stderr", "w") as stderr:  # rank 1 (stopped) keeps it open: not a pipe
        survivor = subprocess.Popen([sys.executable, "-m", "gpt_lightning", *args], cwd=tmp_path, stdout=subprocess.DEVNULL,
                                    stderr=stderr, env={**os.environ, "PYTHONPATH": str(REPO), **ENV})
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


def test_a_strategy_by_name_waits_10_minutes_and_a_timeout_given_wins(in_process_group):
    base = ["--config", str(REPO / "configs/tiny-cpu.yaml"), "--trainer.accelerator", "cpu", "--trainer.devices", "2",
            "--trainer.logger", "false"]
    for strategy, expected in (
        ([], timedelta(minutes=10)),  # auto, on 2 devices: ddp
        (["--trainer.strategy", "ddp"], timedelta(minutes=10)),
        (["--trainer.strategy", "DDPStrategy", "--trainer.strategy.timeout", "0:45:00"], timedelta(minutes=45)),
    ):
        cli = GPTLightningCLI(args=[*base, *strategy], run=False)
        assert type(cli.trainer.strategy).__name__ == "DDPStrategy"
        assert cli.trainer.strategy._timeout == expected, strategy  # what init_process_group gets


def test_a_launch_that_fails_by_itself_is_not_blamed_on_another_rank():
    import torch.distributed as dist

    from gpt_lightning.scaling.dead_rank import peer_went_away, went_away_message

    taken = dist.DistNetworkError("The server socket has failed to listen on any local network address. "
                                  "port: 29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
    assert not peer_went_away(taken)  # its own traceback says what to fix
    gone = dist.DistBackendError("NCCL communicator was aborted on rank 0.\nmore")
    assert peer_went_away(gone)
    assert "(DistBackendError: NCCL communicator was aborted on rank 0.)" in went_away_message(gone)
