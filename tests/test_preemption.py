"""A scheduler's SIGTERM (or Ctrl-C) during ``gpt-lightning fit``: the run saves ``last.ckpt`` at the
end of the optimizer step in flight, exits 143 (130), and the same command relaunched ends at the very
weights of a run never stopped. Real processes and real signals, sent while a chosen micro-batch of
an accumulated step runs; under DDP to one rank only."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gpt_lightning.cli import main

from conftest import REPO

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
# configs/tiny-cpu.yaml (bf16-mixed) shrunk in size and steps; 3 micro-batches of 2 x 16 a step.
TINY = ["fit", "--config", str(REPO / "configs" / "tiny-cpu.yaml"), "--model.compile", "false",
        "--model.n_layer", "1", "--model.n_head", "2", "--model.n_embd", "32", "--model.val_sample_tokens", "0",
        "--data.batch_size", "2", "--data.block_size", "16", "--data.tokens_per_step", "96",
        "--trainer.max_steps", "6", "--trainer.limit_val_batches", "0", "--trainer.enable_progress_bar", "false",
        "--throughput.warmup_steps", "0"]
MICRO = 3


def probe(out_dir: Path) -> str:
    return "--trainer.callbacks+=" + json.dumps(
        {"class_path": "preemption_probe.MicroBatchLog", "init_args": {"out_dir": str(out_dir)}})


def signal_during(process: subprocess.Popen, log: Path, step: int, micro: int, signum: int,
                  pid_of=lambda line: None) -> None:
    """Send ``signum`` while micro-batch ``micro`` of optimizer step ``step`` runs (the probe pauses
    there), to the process whose pid that log line names, or ``process``."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        lines = log.read_text().split("\n") if log.exists() else []
        for line in filter(None, lines):
            at_step, batch_idx, pid = map(int, line.split())
            if at_step == step and batch_idx % MICRO == micro:
                os.kill(pid_of(pid) or process.pid, signum)
                return
        time.sleep(0.02)
    pytest.fail(f"step {step} micro-batch {micro} never ran; exit {process.poll()}")


def last_ckpt(root: Path, name: str, version: int) -> Path:
    return root / name / f"version_{version}" / "checkpoints" / "last.ckpt"


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("whole")
    main([*TINY, "--trainer.logger.init_args.save_dir", str(root), "--trainer.logger.init_args.name", "whole"])
    return last_ckpt(root, "whole", 0)


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_mid_accumulation_saves_the_step_and_the_same_command_resumes_exactly(tmp_path, uninterrupted,
                                                                                          signum, code):
    """Lightning alone exits 0 with no checkpoint on SIGTERM (1 on Ctrl-C, no checkpoint either)."""
    job = [*TINY, "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.logger.init_args.name", "job",
           "--ckpt_path", "last"]
    started = subprocess.Popen([sys.executable, "-m", "gpt_lightning", *job, probe(tmp_path / "steps")], env=ENV,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    signal_during(started, tmp_path / "steps" / "rank0.log", step=2, micro=1, signum=signum)
    sent = time.monotonic()
    _, err = started.communicate(timeout=300)
    assert started.returncode == code, err[-3000:]
    assert time.monotonic() - sent < 30  # well inside a scheduler's grace period
    ckpt = last_ckpt(tmp_path, "job", 0)
    assert f"stopped by {signal.Signals(signum).name} at step 3; saved {ckpt}" in err
    assert load(ckpt)["global_step"] == 3  # the step in flight finished (its third micro-batch ran) and was saved
    main(job)  # the job's requeue: the very same command
    resumed = load(last_ckpt(tmp_path, "job", 1))
    expected = load(uninterrupted)
    assert resumed["global_step"] == expected["global_step"] == 6
    differ = [k for k in expected["state_dict"] if not torch.equal(expected["state_dict"][k], resumed["state_dict"][k])]
    assert not differ, differ


def child_of(pid: int) -> int:
    (child,) = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(child)
