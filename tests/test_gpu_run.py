"""benchmarks/gpu_run.sh, the one-command GPU run, works end to end: here in its CPU smoke mode, so
the script is known to be wired right before it meets a GPU. Its smoke mode runs the generation and
HellaSwag benchmarks on tiny settings, and their reports are checked here (one launch of each for
the suite; the other benchmark scripts are test_benchmarks'), under the run's deadline and status logic."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from gpt_lightning.model import GPT, GPTConfig


def run_script(tmp_path, **env):
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        **env,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    env.pop("GPU_RUN_SMOKE", None)  # --dry-run alone must select the CPU shapes
    return subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_run.sh"), "--dry-run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_the_gpu_run_script_end_to_end_in_smoke_mode(tmp_path):
    """Every step on tiny CPU shapes but autotune (bench again, with --runs model and --model.compile_mode
    max-autotune; 25 s for a mode string torch.compile is given, so a slip there first shows on a GPU).
    overhead_compiled (overhead_eager's command but for --compile) is forced past its limit: it times
    out, the steps before and after it keep their files, and status.txt says so."""
    result = run_script(
        tmp_path,
        GPU_RUN_LIMIT_overhead_compiled="1",
        GPU_RUN_STEPS="bench levers tests generation checks overhead fineweb hellaswag",
    )
    dest = tmp_path / "out" / "cpu"
    status = (dest / "status.txt").read_text().splitlines()
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]  # one step did not end "done"
    assert [line.split(":")[0] for line in status] == [
        "bench",
        "levers",
        "tests",
        "generation",
        "checks",
        "overhead_eager",
        "overhead_compiled",
        "fineweb",
        "hellaswag",
    ], status
    assert status[6] == "overhead_compiled: timed out after 1s"
    assert all(": done in " in line for line in status[:6] + status[7:]), status
    assert not (dest / "lightning_overhead_compiled.json").exists()
    assert (dest / "logs" / "overhead_compiled.txt").exists()
    saved = json.loads((dest / "bench.json").read_text())
    assert set(saved["runs"]) == {"eager", "blocks", "gpt2-124m-fast"}
    assert saved["summary"]["blocks"]["max_loss_diff_vs_eager"] is not None
    assert saved["summary"]["gpt2-124m-fast"]["max_loss_diff_vs_eager"] is None  # another config: not compared
    assert saved["runs"]["gpt2-124m-fast"]["compile_scope"] == "blocks"
    assert (dest / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert "skipped" in (dest / "gpu_tests.txt").read_text()  # the GPU tests' output is kept
    # benchmarks/levers.py: the defaults, then each lever on, on the fast config (one process in the dry run)
    levers = json.loads((dest / "levers.json").read_text())
    assert levers["config"] == "configs/gpt2-124m-fast.yaml" and levers["in_process"]
    assert {name: run["args"] for name, run in levers["runs"].items()} == {
        "defaults": [],
        "chunked_loss_on": ["--model.chunked_loss", "true"],
        "cudnn_attention_on": ["--model.cudnn_attention", "true"],
    }
    assert all(len(run["losses"]) == 3 and run["tokens_per_sec_median"] > 0 for run in levers["runs"].values())
    assert not levers["levers"]["chunked_loss"]["applies"] and not levers["levers"]["cudnn_attention"]["applies"]
    assert all(lever["max_loss_diff"] is not None for lever in levers["levers"].values())
    # the FineWeb recipe's micro-batch through bench
    fineweb = json.loads((dest / "fineweb-b64" / "bench.json").read_text())
    assert list(fineweb["runs"]) == ["blocks"] and "50304" in fineweb["runs"]["blocks"]["args"]
    assert fineweb["summary"]["blocks"]["compile_time_s"] is not None and not (dest / "autotune").exists()
    # benchmarks/generation.py (tiny, batch sizes 1 and 2, bf16): ours eager and compiled, transformers'
    # generate with its dynamic and its static cache and the uncached path, from a tiny Shakespeare prompt.
    written = json.loads((dest / "generation.json").read_text())
    generation, roofline = written["results"], written["roofline"]  # each figure beside its bound (a roofline)
    assert written["prompt"] == "tiny Shakespeare" and written["dtype"] == "bfloat16"
    # bf16 weights, the position table (32 x 32) left out: a pass reads only its positions' rows
    assert roofline["weight_bytes_per_step"] == 2 * (
        GPT(GPTConfig(block_size=32, n_layer=1, n_head=2, n_embd=32)).num_parameters() - 32 * 32
    )
    assert roofline["matmul_dtype"] == "bfloat16" and roofline["matmul_flops_per_sec"] > 0
    assert roofline["read_bandwidth_bytes_per_sec"] == max(roofline["bandwidth_probes"]) > 0
    for batch, row in generation.items():
        bound = row["bound"]
        assert bound["tokens_per_sec"] == pytest.approx(int(batch) * 6 / bound["seconds"])  # 6 new tokens
        assert bound["memory_bound_passes"] + bound["compute_bound_passes"] == 6  # the prefill and 5 decode steps
        for name in ("ours", "transformers", "ours_compiled", "transformers_static"):
            assert row[name]["fraction_of_bound"] == pytest.approx(
                row[name]["tokens_per_sec"] / bound["tokens_per_sec"]
            )
    assert "% of bound)" in result.stdout
    assert set(generation) == {"1", "2"}
    assert generation["1"]["ours_vs_transformers"] > 0 and generation["1"]["ours_vs_uncached"] > 0
    assert generation["2"]["transformers_static"]["tokens_per_sec"] > 0
    assert "ours_uncached" not in generation["2"]  # the slow path only where asked (batch 1 by default)
    # same weights, same tokens (bf16: a tie could flip one; none did on this model)
    assert generation["1"]["greedy_tokens_equal"] == {
        "ours": True,
        "ours_compiled": True,
        "transformers_static": True,
        "ours_uncached": True,
    }
    assert generation["2"]["ours_compiled_vs_transformers_best"] > 0  # warmed by a short run, then timed
    assert "ours/transformers" in result.stdout
    # benchmarks/hellaswag.py (5 examples, batches of 2: a partial last batch): the same answers batched.
    hellaswag = json.loads((dest / "hellaswag.json").read_text())
    assert set(hellaswag["results"]) == {"per_example_before", "batched_2"}
    assert hellaswag["same_answers_as_before"] and hellaswag["results"]["batched_2"]["result"]["examples"] == 5
    # benchmarks/lightning_overhead.py: the three loops side by side, each step's host time in parts.
    check_overhead_report(dest / "lightning_overhead.json", result.stdout + result.stderr)
    # benchmarks/gpu_checks.py (issue 35): accumulation, quiet steps, Muon's memory, bf16 sampling.
    checks = json.loads((dest / "gpu_checks.json").read_text())
    assert checks["accumulation"]["eager"]["ok"] and len(checks["accumulation"]["eager"]["losses"]) == 2
    assert checks["shape"]["tokens_per_step"] == 2 * 32 * 2
    assert checks["quiet_steps"]["steps"] == 2 and "error" not in checks["quiet_steps"]
    assert set(checks["memory"]["peak_gib"]) == {"adamw", "muon"}
    sampling = checks["sampling"]
    assert sampling["device"] == "cpu" and sampling["greedy_tokens_equal"] in (True, False)
    assert sampling["bfloat16"]["tokens_per_sec"] > 0 and sampling["teacher_forced"]["positions"] == 32
    assert (
        0 < sampling["teacher_forced"]["max_abs_logprob_diff"] < 1
        and sampling["teacher_forced"]["top1_agreement"] > 0.5
    )


def test_the_gpu_run_skips_what_its_deadline_leaves_no_time_for(tmp_path):
    result = run_script(tmp_path, GPU_RUN_DEADLINE="0", GPU_RUN_STEPS="bench checks autotune hellaswag")
    status = (tmp_path / "out" / "cpu" / "status.txt").read_text().splitlines()
    assert result.returncode == 1 and [line.split(" (")[0] for line in status] == [
        "bench: skipped for time",
        "checks: skipped for time",
        "autotune_cold: skipped for time",
        "autotune_warm: skipped for time",
        "hellaswag: skipped for time",
    ]
    assert not (tmp_path / "out" / "cpu" / "bench.json").exists()


def check_overhead_report(out: Path, output: str) -> None:
    """benchmarks/lightning_overhead.py's report of 2 rounds of 8 eager steps (2 of them warm-up), logging every 5."""
    eager = json.loads(out.read_text())["results"]["eager"]
    assert eager["steps_measured_each"] == 12  # 2 rounds x 6 post-warm-up steps: the left-out first runs are not pooled
    assert eager["ratio"] > 0 and "ratio" in output
    # where a step's time goes, per loop: the parts add up to the step, ours only where ours run
    parts = eager["breakdown"]
    assert set(parts) == {"plain", "plain_ours", "lightning"}
    assert parts["plain"]["nonfinite_guard"]["mean_ms"] == 0 < parts["plain_ours"]["nonfinite_guard"]["mean_ms"]
    assert parts["lightning"]["forward"]["mean_ms"] > 0 and parts["lightning"]["step_logging"]["mean_ms"] > 0
    assert eager["unequal_settings"] == []  # same optimizer flags, precision, threads in every loop
    # the host's own work per step, beside the shared compute, per loop and as differences (no
    # timing is asserted: at this size and under a parallel suite their order is noise)
    host = eager["host_ms_per_step"]
    assert set(host) == {"plain", "plain_ours", "lightning"} and all(ms > 0 for ms in host.values())
    assert eager["host_ms_added_by_lightning"] == host["lightning"] - host["plain_ours"]
    assert eager["host_ms_added_by_our_work"] == host["plain_ours"] - host["plain"]
    # what Lightning adds, by who adds it, is all of it
    by = eager["host_ms_added_by_lightning_parts"]
    assert set(by) == {"trainer_loop", "callbacks_and_logger", "module_hooks"}
    assert sum(by.values()) == pytest.approx(eager["host_ms_added_by_lightning"])
    assert by["callbacks_and_logger"] > 0  # ThroughputMonitor, the bar and the logger run only in ours
    assert all(parts[loop]["rest"]["mean_ms"] >= 0 for loop in parts)  # exclusive parts never exceed the step
    # every step counted (the logging steps too) beside the medians; the runs left out went past a logging step
    assert eager["ratio_total_time"] > 0 and eager["left_out_runs"] == {
        "steps": 6,
        "loops": ["plain", "plain_ours", "lightning"],
    }
    # the left-out Lightning run did run: one fit of 6 steps, then the 2 measured
    assert output.count("`max_steps=6` reached") == 1 and output.count("`max_steps=8` reached") == 2
    # the CPU estimate: a plain step (mean, logging steps too) plus what ours adds on the host and in other threads
    added = {loop: host[loop] + parts[loop]["other_threads_cpu"]["mean_ms"] for loop in ("plain", "lightning")}
    plain_step = parts["plain"]["step"]["mean_ms"]
    assert eager["ratio_from_host_time"] == pytest.approx(
        plain_step / (plain_step + added["lightning"] - added["plain"])
    )
    assert len(eager["ratio_per_round"]) == 2 == len(eager["compute_ratio_per_round"])
    assert all(r > 0 for r in eager["compute_ratio_per_round"])
    table = out.with_suffix(".md").read_text()
    assert "| part |" in table and "| page faults (median) |" in table  # the loops' allocations, side by side
    assert all(isinstance(parts[loop]["page_faults"]["median"], (int, float)) for loop in parts)
