"""`gpt-lightning bench` on a very small CPU config: table, JSON, PNG, and the divergence exit."""

import json

from test_cli import REPO, run_cli


def test_bench_writes_json_and_png_and_fails_on_divergence(cache_dir, tmp_path):
    result = run_cli(
        "bench", "--config", str(REPO / "configs/tiny-cpu.yaml"), "--every", "2",
        "--tolerance", "-1",  # any difference at all counts as divergence: exercises the failure path
        "--trainer.max_steps", "6", "--throughput.warmup_steps", "2", "--trainer.val_check_interval", "3",
        "--trainer.limit_val_batches", "1", "--model.n_layer", "1", "--model.n_embd", "32",
        "--model.n_head", "2", "--data.block_size", "32",
        "--trainer.logger.init_args.save_dir", str(tmp_path / "tb"),
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "FAIL: the loss curves diverge" in result.stdout
    assert "speedup" in result.stdout
    (run_dir,) = (tmp_path / "tb" / "bench").iterdir()
    assert {p.name for p in run_dir.iterdir()} >= {"eager", "compiled", "bench.json", "bench.png"}
    saved = json.loads((run_dir / "bench.json").read_text())
    assert saved["speedup"] > 0
    assert len(saved["runs"]["eager"]["loss"]) == len(saved["runs"]["compiled"]["loss"]) == 6
    assert saved["runs"]["compiled"]["summary"]["compiled"] is True
    assert saved["runs"]["eager"]["summary"]["compiled"] is False
    assert saved["max_loss_diff"] < 0.5  # same seed, same batches: the curves stay close
    assert (run_dir / "bench.png").read_bytes()[:4] == b"\x89PNG"
