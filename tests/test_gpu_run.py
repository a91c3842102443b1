"""benchmarks/gpu_run.sh, the one-command GPU run, works end to end: here in its CPU smoke mode, so
the script is known to be wired right before it meets a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO


def test_the_gpu_run_script_end_to_end_in_smoke_mode(tmp_path):
    env = {**os.environ, "GPU_RUN_SMOKE": "1", "OUT": str(tmp_path / "out"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_run.sh")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    dest = tmp_path / "out" / "cpu"
    saved = json.loads((dest / "bench.json").read_text())
    assert set(saved["runs"]) == {"eager", "blocks", "gpt2-124m-fast"}
    assert saved["summary"]["blocks"]["max_loss_diff_vs_eager"] is not None
    assert saved["summary"]["gpt2-124m-fast"]["max_loss_diff_vs_eager"] is None  # another config: not compared
    assert saved["runs"]["gpt2-124m-fast"]["compile_scope"] == "blocks"
    assert (dest / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "skipped" in (dest / "gpu_tests.txt").read_text()  # the GPU tests' output is kept
    generation = json.loads((dest / "generation.json").read_text())
    assert set(generation["results"]) == {"1", "2"} and generation["results"]["1"]["ours_vs_uncached"] > 0
    assert json.loads((dest / "hellaswag.json").read_text())["same_answers_as_before"]
