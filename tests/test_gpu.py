"""Checks that need a CUDA GPU. They skip cleanly without one; benchmarks/gpu_run.sh runs them."""

import json

import pytest
import torch

from gpt_lightning.cli import main

from conftest import REPO

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def fit_on_cuda(small_text, tmp_path, *extra):
    main([
        "fit", "--config", str(REPO / "configs" / "tiny-cpu.yaml"), "--trainer.accelerator", "cuda",
        "--data.data_path", str(small_text), "--trainer.limit_val_batches", "0",
        "--checkpoint.every_n_train_steps", "1000", "--trainer.logger.init_args.save_dir", str(tmp_path / "tb"), *extra,
    ])
    (run_dir,) = (tmp_path / "tb" / "tiny-cpu").iterdir()
    return json.loads((run_dir / "throughput.json").read_text())


@pytest.mark.parametrize("compile", ["false", "true"])
def test_no_synchronizing_call_between_logging_intervals(compile, small_text, tmp_path):
    probe = {"class_path": "host_reads.SyncDebugProbe", "init_args": {"out": str(tmp_path / "watched.json")}}
    fit_on_cuda(small_text, tmp_path, "--model.compile", compile, "--trainer.max_steps", "21",
                "--trainer.log_every_n_steps", "5", f"--trainer.callbacks+={json.dumps(probe)}")
    watched = json.loads((tmp_path / "watched.json").read_text())["watched"]
    assert len(watched) == 12  # steps 1-3, 6-8, 11-13, 16-18 ran with synchronizing calls forbidden


def test_throughput_on_a_gpu_uses_cuda_events_and_reports_memory_and_mfu(small_text, tmp_path):
    summary = fit_on_cuda(small_text, tmp_path, "--trainer.max_steps", "30")
    assert summary["accelerator"] == "cuda" and summary["compiled"] is True
    assert summary["peak_device_memory_bytes"] > 0 and summary["tokens_per_sec_median"] > 0
    if any(name in summary["device"] for name in ("A100", "H100", "H200")):
        assert 0 < summary["mfu"] < 1
