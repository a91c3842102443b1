"""The benchmark scripts run (tiny settings, no timing asserted: speed is judged by their reports)."""

import json
import subprocess
import sys

from conftest import REPO


def run_script(name, *args, cwd):
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / name), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})


def test_overhead_benchmark_reports_a_ratio(cache_dir, tmp_path):
    out = tmp_path / "overhead.json"
    result = run_script(
        "lightning_overhead.py", "--compile", "false", "--steps", "8", "--warmup", "2", "--rounds", "2",
        "--n_layer", "1", "--n_embd", "32", "--n_head", "2", "--block_size", "32", "--batch_size", "2",
        "--out", str(out), cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    eager = json.loads(out.read_text())["results"]["eager"]
    assert eager["steps_measured_each"] == 12
    assert eager["ratio"] > 0 and "ratio" in result.stdout


def test_data_loading_benchmark_reports_a_multiple(cache_dir, tmp_path):
    result = run_script("data_loading.py", "--batches", "20", "--repeats", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "x faster" in result.stdout


def test_export_memory_benchmark_reports_peaks_against_the_weights(tmp_path):
    result = run_script("export_memory.py", "--shape", "tiny", "--modes", "export", "--workdir", str(tmp_path),
                        cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["weight_bytes"] == 4 * (50257 * 32 + 1024 * 32 + 12 * 32 * 32 + 13 * 32 + 2 * 32)  # tiny's weights
    assert report["export"]["peak_bytes"] > report["weight_bytes"]
