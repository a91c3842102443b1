"""The examples run as users would run them."""

import os
import subprocess
import sys

from conftest import REPO


def run_example(name, *args, cwd):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, str(REPO / "examples" / name), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_own_trainer_example(cache_dir, tmp_path):
    result = run_example("own_trainer.py", "--max_steps", "8", "--log_dir", str(tmp_path / "logs"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "final train/loss" in result.stdout and "median tokens/s" in result.stdout
    assert list((tmp_path / "logs" / "own-trainer").glob("version_0/throughput.json"))


def test_throughput_only_example(tmp_path):
    result = run_example("throughput_only.py", "--max_steps", "12", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MFU" in result.stdout
