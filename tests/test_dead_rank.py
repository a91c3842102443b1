"""A rank that dies (SIGKILL: an OOM kill, a lost node) in a 2-process gloo job on the CPU: the
survivor stops with one line that says a rank went away and how to resume, and a torchrun launch
with --max-restarts comes back by itself, resumes from last.ckpt and ends at the weights of the run
that was never interrupted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from test_cli import run_cli
from test_ddp import ENV, fit_args, free_port


def kill(rank: int, step: int) -> str:
    return "--trainer.callbacks+=" + json.dumps({"class_path": "ddp_probe.KillRank", "init_args": {"rank": rank, "step": step}})


def test_the_survivor_of_a_dead_rank_says_so_in_one_line(small_text, tmp_path):
    result = run_cli(*fit_args(small_text, tmp_path, max_steps=8), "--trainer.devices", "2", kill(1, 3),
                     cwd=tmp_path, env_extra=ENV)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert lines[-1].startswith("gpt-lightning: error: another rank of this run went away"), lines[-5:]
    assert "--ckpt_path last" in lines[-1]
