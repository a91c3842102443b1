"""The examples run as users would run them; the multi-node launch scripts parse."""

import re
import runpy
import shlex
import sys
from unittest import mock

import pytest
import yaml
from conftest import REPO

from gpt_lightning.cli import main


@pytest.fixture
def run_example(monkeypatch, capfd, tmp_path, in_process_group):
    """``python examples/NAME ARGS`` in this process, in ``tmp_path``: its printed output (stdout + stderr)."""
    monkeypatch.chdir(tmp_path)

    def run(name, *args):
        with mock.patch.object(sys, "argv", [name, *args]):
            runpy.run_path(str(REPO / "examples" / name), run_name="__main__")
        out, err = capfd.readouterr()
        return out + err

    return run


def test_own_trainer_example(cache_dir, tmp_path, run_example):
    printed = run_example("own_trainer.py", "--max_steps", "8", "--log_dir", str(tmp_path / "logs"))
    assert "final train/loss" in printed and "median tokens/s" in printed
    assert re.search(r"step: +100%.* 8/8", printed)  # StepProgressBar counted the optimizer steps
    assert list((tmp_path / "logs" / "own-trainer").glob("version_0/throughput.json"))


def test_throughput_only_example(run_example):
    assert "MFU" in run_example("throughput_only.py", "--max_steps", "12")


@pytest.mark.parametrize("script", ["slurm_multinode.sbatch", "torchrun_multinode.sh"])
def test_multinode_launch_scripts_parse(script, capfd):
    """The fit command line of each launch script parses (the launchers themselves need a cluster)."""
    text = (REPO / "examples" / script).read_text().replace("\\\n", " ")
    words = shlex.split(text[text.index("fit --config") :].splitlines()[0])
    words = [
        w.replace('"$SLURM_JOB_NUM_NODES"', "2").replace("$SLURM_JOB_NUM_NODES", "2").replace("$NNODES", "2")
        for w in words
    ]
    with pytest.raises(SystemExit) as exit_info:
        main([*words, "--print_config"])
    assert exit_info.value.code == 0, capfd.readouterr().err
    printed = yaml.safe_load(capfd.readouterr().out)
    trainer = printed["trainer"]
    assert (trainer["num_nodes"], str(trainer["devices"]), trainer["strategy"]) == (2, "8", "ddp")  # devices: int | str
    assert printed["data"]["tokens_per_step"] == 524288


def test_torchrun_restart_script_resumes_from_last(capfd):
    """examples/torchrun_restart.sh relaunches with --max-restarts and resumes with --ckpt_path last
    (tests/test_ddp.py runs the same under torchrun on the CPU); its fit line parses."""
    text = (REPO / "examples" / "torchrun_restart.sh").read_text().replace("\\\n", " ")
    assert "--max-restarts" in text
    words = shlex.split(text[text.index("fit --config") :].splitlines()[0].replace('"$NPROC"', "8"))
    assert words[-2:] == ["--ckpt_path", "last"]
    with pytest.raises(SystemExit) as exit_info:
        main([*words[:-2], "--print_config"])  # `last` needs a run to resume: the rest must parse
    assert exit_info.value.code == 0, capfd.readouterr().err
    trainer = yaml.safe_load(capfd.readouterr().out)["trainer"]
    assert (str(trainer["devices"]), trainer["strategy"]) == ("8", "ddp")
