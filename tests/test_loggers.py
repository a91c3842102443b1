"""Any logger through ``gpt-lightning fit``: none (``--trainer.logger false``), CSV (no text: the
samples go to ``samples.txt``), TensorBoard (``val/*``, ``eval/*`` and the samples at the same
step); and under DDP the validation metrics log without Lightning's ``sync_dist`` warning."""

import csv
import json
from pathlib import Path

import pytest
from conftest import TINY_FIT, tiny_flags
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_hellaswag import synthetic_examples, write_examples

from gpt_lightning.cli import main

# configs/tiny-cpu.yaml as written (bf16-mixed), shrunk: 2 steps, validating (and sampling) at step 2.
TINY = [
    *TINY_FIT,
    *tiny_flags(
        {
            "model.val_sample_tokens": 4,
            "data.block_size": 32,
            "trainer.max_steps": 2,
            "trainer.val_check_interval": 2,
            "trainer.limit_val_batches": 1,
            "throughput.warmup_steps": 1,
        }
    ),
]


def test_without_a_logger_the_run_writes_its_files_to_the_working_directory(small_text, tmp_path, monkeypatch, caplog):
    """It ended in "Cannot use `LearningRateMonitor` callback with `Trainer` that has no logger" (exit 2)."""
    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO")
    main([*TINY, "--data.data_path", str(small_text), "--trainer.logger", "false"])
    assert {"checkpoints", "config.yaml", "throughput.json", "samples.txt"} <= {p.name for p in tmp_path.iterdir()}
    assert (tmp_path / "samples.txt").read_text().startswith("--- step 2 ---\n")
    assert f"Validation samples: no logger; they go to {tmp_path / 'samples.txt'}." in caplog.text
    # --ckpt_path last is Lightning's: the checkpoint in the working directory's checkpoints/.
    main(
        [
            *TINY,
            "--data.data_path",
            str(small_text),
            "--trainer.logger",
            "false",
            "--trainer.max_steps",
            "3",
            "--ckpt_path",
            "last",
        ]
    )
    assert f"Restored all states from the checkpoint at {tmp_path / 'checkpoints' / 'last.ckpt'}" in caplog.text


def test_csv_logger_gets_the_samples_in_a_file_of_its_run_said_once(small_text, tmp_path, monkeypatch, caplog):
    """Before, the samples went nowhere without a word with any logger but TensorBoard."""
    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO")
    main(
        [
            *TINY,
            "--data.data_path",
            str(small_text),
            "--trainer.max_steps",
            "4",
            "--trainer.logger",
            "lightning.pytorch.loggers.CSVLogger",
            "--trainer.logger.save_dir",
            "csv",
        ]
    )
    (run_dir,) = (tmp_path / "csv" / "tiny-cpu").iterdir()
    samples = (run_dir / "samples.txt").read_text()
    assert [line for line in samples.splitlines() if line.startswith("---")] == ["--- step 2 ---", "--- step 4 ---"]
    assert caplog.text.count("Validation samples: CSVLogger takes no text; they go to") == 1
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [int(r["step"]) for r in rows if r["val/loss"]] == [2, 4]  # the samples' steps
    assert all(r["epoch"] != "" for r in rows if r["val/loss"])  # as on every row Lightning logs
    # --ckpt_path last finds the newest CSV run, numbered as TensorBoard's.
    main(
        [
            *TINY,
            "--data.data_path",
            str(small_text),
            "--trainer.max_steps",
            "5",
            "--ckpt_path",
            "last",
            "--trainer.logger",
            "lightning.pytorch.loggers.CSVLogger",
            "--trainer.logger.save_dir",
            "csv",
        ]
    )
    assert f"--ckpt_path last: resuming from {Path('csv/tiny-cpu/version_0/checkpoints/last.ckpt')}" in caplog.text


def test_ckpt_path_last_with_a_logger_that_starts_a_new_folder_each_launch_says_what_to_give(
    small_text, tmp_path, monkeypatch, capsys
):
    """W&B (and MLflow) make a new run folder at each launch: --ckpt_path last looked in ``./<name>/version_*``,
    found nothing, and started fresh at every requeue."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                *TINY,
                "--data.data_path",
                str(small_text),
                "--trainer.logger",
                "lightning.pytorch.loggers.WandbLogger",
                "--ckpt_path",
                "last",
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "WandbLogger starts a new run folder at each launch. Give every launch the same --checkpoint.dirpath" in err


def test_validation_evaluation_and_samples_land_at_the_same_step(small_text, tmp_path, monkeypatch):
    """``val/*`` landed one step before ``eval/*`` for the same validation point: Lightning logs
    validation at its count of steps before the one just done."""
    monkeypatch.chdir(tmp_path)
    path = write_examples(tmp_path / "val.jsonl", synthetic_examples(2))
    evaluator = {
        "class_path": "gpt_lightning.HellaSwagEval",
        "init_args": {"data_file": str(path), "every_n_steps": 2, "limit": 2, "batch_size": 2},
    }
    main(
        [
            *TINY,
            "--data.data_path",
            str(small_text),
            "--trainer.max_steps",
            "4",
            f"--trainer.callbacks+={json.dumps(evaluator)}",
            "--trainer.logger.init_args.save_dir",
            "tb",
        ]
    )
    (run_dir,) = (tmp_path / "tb" / "tiny-cpu").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    steps = {tag: [e.step for e in events.Scalars(tag)] for tag in ("val/loss", "val/bpb", "eval/hellaswag_acc_norm")}
    assert steps == {"val/loss": [2, 4], "val/bpb": [2, 4], "eval/hellaswag_acc_norm": [0, 2, 4]}
    (tag,) = [tag for tag in events.Tags()["tensors"] if tag.startswith("samples")]
    assert [e.step for e in events.Tensors(tag)] == [2, 4]


def test_under_ddp_validation_logs_its_reduced_value_without_the_sync_dist_warning(
    small_text, tmp_path, monkeypatch, recwarn, in_process_group
):
    """One gloo process under ``--trainer.strategy ddp``: Lightning's check is whether a process
    group exists. The metrics are torchmetrics objects, summed over ranks at compute(); as tensors
    Lightning asked for ``sync_dist``, which would all-reduce them again. The logged value is a
    plain validation's of the same weights."""
    import torch
    from lightning.pytorch import Trainer

    from gpt_lightning import GPTLightningModule, TokenStreamDataModule

    monkeypatch.chdir(tmp_path)
    main(
        [
            *TINY,
            "--data.data_path",
            str(small_text),
            "--trainer.strategy",
            "ddp",
            "--trainer.precision",  # the plain validation's below, wherever auto would pick float32
            "bf16-mixed",
            "--model.val_sample_tokens",
            "0",
            "--trainer.logger.init_args.save_dir",
            "tb",
        ]
    )
    assert not [str(w.message) for w in recwarn if "sync_dist" in str(w.message)]
    (run_dir,) = (tmp_path / "tb" / "tiny-cpu").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    logged = {tag: events.Scalars(tag)[-1].value for tag in ("val/loss", "val/perplexity", "val/bpb")}
    module = GPTLightningModule.load_from_checkpoint(run_dir / "checkpoints" / "last.ckpt", map_location="cpu")
    data = TokenStreamDataModule(str(small_text), batch_size=2, block_size=32)
    with torch.no_grad():
        (plain,) = Trainer(
            accelerator="cpu",
            precision="bf16-mixed",
            logger=False,
            limit_val_batches=1,
            enable_progress_bar=False,
            enable_model_summary=False,
        ).validate(module, data, verbose=False)
    assert logged == pytest.approx({tag: plain[tag] for tag in logged}, rel=1e-6)


def test_a_logger_with_wandbs_log_text_gets_the_samples_as_lightnings_wandb_logger_takes_them(tmp_path):
    """W&B is not installed here: a CSV logger given ``log_text`` is told what ``WandbLogger.log_text`` is
    (a table), in a call that binds to that method's signature."""
    import inspect

    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    from gpt_lightning.observing.samples import text_writers

    calls = []

    class CSVWithText(CSVLogger):
        def log_text(self, *args, **kwargs):
            calls.append((args, kwargs))

    (write,) = text_writers(Trainer(logger=CSVWithText(tmp_path), accelerator="cpu", devices=1))
    write("ROMEO: hi", 7)
    ((args, kwargs),) = calls
    bound = inspect.signature(WandbLogger.log_text).bind(None, *args, **kwargs).arguments
    assert (bound["key"], bound["columns"], bound["data"], bound["step"]) == (
        "samples",
        ["step", "text"],
        [[7, "ROMEO: hi"]],
        7,
    )
    assert not (tmp_path / "samples.txt").exists()
