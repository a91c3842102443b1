"""Two CPU processes under Lightning's DDP (gloo): disjoint windows, global loss and throughput."""

import json
import os

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gpt_lightning.data import gpt2_encoding

from test_cli import REPO, run_cli


def test_ddp_on_two_cpu_processes(small_text, tmp_path):
    probe = {"class_path": "ddp_probe.RecordRank", "init_args": {"out_dir": str(tmp_path / "ranks")}}
    result = run_cli(
        "fit", "--config", str(REPO / "configs/tiny-cpu.yaml"),
        "--trainer.strategy", "ddp", "--trainer.devices", "2", "--trainer.accelerator", "cpu",
        "--trainer.precision", "32-true", "--model.compile", "false",
        "--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2",
        "--data.data_path", str(small_text), "--data.cache_dir", str(tmp_path / "cache"),
        "--data.batch_size", "2", "--data.block_size", "32",
        "--trainer.max_steps", "6", "--trainer.log_every_n_steps", "1", "--trainer.limit_val_batches", "0",
        "--throughput.warmup_steps", "2", f"--trainer.callbacks+={json.dumps(probe)}",
        "--trainer.logger.init_args.save_dir", str(tmp_path / "tb"),
        cwd=tmp_path,
        env_extra={"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # Each process trains (train tokens - 1) // (world x B x T) batches an epoch, and is told so.
    n = len(gpt2_encoding().encode_ordinary(small_text.read_text()))
    per_rank = (n - int(n * 0.1) - 1) // (2 * 2 * 32)
    assert f"1 epoch = {per_rank} batches per process" in result.stdout + result.stderr
    ranks = [json.loads((tmp_path / "ranks" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in ranks] == [2, 2]

    # Disjoint windows: rank r reads batches r, r+2, ... of the stream.
    seen = [{tuple(row) for window in r["windows"] for row in window} for r in ranks]
    assert len(ranks[0]["windows"]) == len(ranks[1]["windows"]) == 6
    assert not seen[0] & seen[1]

    (run_dir,) = (tmp_path / "tb" / "tiny-cpu").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    # The logged loss is the mean over both ranks, not rank 0's own.
    logged = [e.value for e in events.Scalars("train/loss")]
    mean_of_ranks = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    assert logged == pytest.approx(mean_of_ranks, rel=1e-5)
    assert logged != pytest.approx(ranks[0]["losses"], rel=1e-5)

    # Tokens/sec is the sum of what each rank processed.
    summary = json.loads((run_dir / "throughput.json").read_text())
    assert summary["world_size"] == 2
    expected = sum(r["local_median_tokens_per_sec"] for r in ranks)
    assert summary["tokens_per_sec_median"] == pytest.approx(expected, rel=1e-5)
