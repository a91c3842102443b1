"""benchmarks/gpu_run.sh, the one-command GPU run, works end to end: here in its CPU smoke mode, so
the script is known to be wired right before it meets a GPU. Its smoke mode runs the generation and
HellaSwag benchmarks on tiny settings, and their reports are checked here (one launch of each for
the suite; the other benchmark scripts are test_benchmarks')."""

import json
import os
import subprocess
import sys
from pathlib import Path

from gpt_lightning.model import GPT, GPTConfig

from conftest import REPO


def test_the_gpu_run_script_end_to_end_in_smoke_mode(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("GPU_RUN_SMOKE", None)  # --dry-run alone must select the CPU shapes
    result = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu_run.sh"), "--dry-run"], cwd=tmp_path, env=env,
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
    # benchmarks/generation.py (tiny, batch sizes 1 and 2): ours, transformers' generate and the
    # uncached path side by side, greedy tokens equal (these were test_benchmarks' own launches).
    written = json.loads((dest / "generation.json").read_text())
    generation, roofline = written["results"], written["roofline"]  # each figure set against the memory-bandwidth ceiling
    assert roofline["weight_bytes_per_step"] == 4 * GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)).num_parameters()
    assert roofline["ceiling_steps_per_sec"] == roofline["read_bandwidth_bytes_per_sec"] / roofline["weight_bytes_per_step"]
    assert generation["1"]["ours"]["steps_per_sec_of_ceiling"] > 0 and generation["2"]["transformers"]["steps_per_sec_of_ceiling"] > 0
    assert set(generation) == {"1", "2"}
    assert generation["1"]["ours_vs_transformers"] > 0 and generation["1"]["ours_vs_uncached"] > 0
    assert "ours_uncached" not in generation["2"]  # the slow path only where asked (batch 1 by default)
    assert generation["1"]["greedy_tokens_equal"] == {"ours": True, "ours_uncached": True}  # same weights, same tokens
    assert "ours/transformers" in result.stdout
    # benchmarks/hellaswag.py (5 examples, batches of 2: a partial last batch): the same answers batched.
    hellaswag = json.loads((dest / "hellaswag.json").read_text())
    assert set(hellaswag["results"]) == {"per_example_before", "batched_2"}
    assert hellaswag["same_answers_as_before"] and hellaswag["results"]["batched_2"]["result"]["examples"] == 5
    # benchmarks/optimizers.py: the AdamW-vs-Muon pair, its curves against tokens and the picture.
    optimizers = json.loads((dest / "optimizers.json").read_text())
    assert [r["optimizer"] for r in optimizers["runs"]] == ["adamw", "muon"]
    assert all(len(r["curve"]) == 3 for r in optimizers["runs"])  # before training and after each of 2 steps
    assert (dest / "optimizers.png").read_bytes()[:4] == b"\x89PNG"
    # benchmarks/architectures.py: GPT-2 + Muon against the modern GPT + Muon (the 124M preset's switches and rates).
    architectures = json.loads((dest / "architectures.json").read_text())
    (seed,) = architectures["seeds"]
    assert [(r["group"], r["embedding_learning_rate"]) for r in seed["runs"]] == [("gpt2 muon", None), ("modern muon", 0.3)]
    assert architectures["modern"]["logit_softcap"] == 30.0 and all(len(r["curve"]) == 3 for r in seed["runs"])
    assert set(architectures["headline"]["targets"]) == {"modern_muon_to_best_gpt2_muon"}
    assert (dest / "architectures.png").read_bytes()[:4] == b"\x89PNG"
    # benchmarks/lightning_overhead.py: the three loops side by side, each step's host time in parts.
    overhead = json.loads((dest / "lightning_overhead.json").read_text())["results"]["eager"]
    assert set(overhead["breakdown"]) == {"plain", "plain_ours", "lightning"} and overhead["ratio"] > 0
    # benchmarks/gpu_checks.py (issue 35): accumulation, quiet steps, Muon's memory, bf16 sampling.
    checks = json.loads((dest / "gpu_checks.json").read_text())
    assert checks["accumulation"]["eager"]["ok"] and len(checks["accumulation"]["eager"]["losses"]) == 2
    assert checks["shape"]["tokens_per_step"] == 2 * 32 * 2
    assert checks["quiet_steps"]["steps"] == 2 and "error" not in checks["quiet_steps"]
    assert set(checks["memory"]["peak_gib"]) == {"adamw", "muon"}
    assert checks["sampling"]["greedy_tokens_equal"] in (True, False) and checks["sampling"]["bfloat16"]["tokens_per_sec"] > 0
