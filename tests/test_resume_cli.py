"""`fit --ckpt_path` through the CLI, as a user types it: what the user gives wins, the checkpoint
fills in the rest, and another architecture is refused with the difference named."""

import json

import pytest
import yaml
from conftest import TINY_FIT, tiny_flags
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gpt_lightning.cli import main
from gpt_lightning.data.tokenizer import gpt2_encoding


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, shakespeare):
    """A compiled 2-step run from a user's own config file; its last.ckpt and the config."""
    root = tmp_path_factory.mktemp("resume")
    (root / "corpus.txt").write_text(shakespeare[:20_000])
    config = root / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "trainer": {
                    "accelerator": "cpu",
                    "precision": "bf16-mixed",
                    "max_steps": 2,
                    "limit_val_batches": 0,
                    "log_every_n_steps": 1,
                    "logger": {
                        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                        "init_args": {"save_dir": str(root / "tb"), "name": "run"},
                    },
                },
                "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "compile": True, "val_sample_tokens": 0},
                "data": {
                    "data_path": str(root / "corpus.txt"),
                    "batch_size": 2,
                    "block_size": 32,
                    "cache_dir": str(root / "cache"),
                },
                "throughput": {"warmup_steps": 0},
            }
        )
    )
    main(["fit", "--config", str(config)])
    run_dir = root / "tb" / "run" / "version_0"
    assert json.loads((run_dir / "throughput.json").read_text())["compiled"] is True
    return root, config, run_dir / "checkpoints" / "last.ckpt"


def newest_run(root):
    return max((root / "tb" / "run").iterdir(), key=lambda p: int(p.name.split("_")[1]))


def hparams(run_dir):
    return yaml.safe_load((run_dir / "hparams.yaml").read_text())


def test_flags_given_on_resume_win_over_the_checkpoint(first_run):
    root, config, ckpt = first_run
    main(
        [
            "fit",
            "--config",
            str(config),
            "--ckpt_path",
            str(ckpt),
            "--trainer.max_steps",
            "4",
            "--model.compile",
            "false",
            "--model.learning_rate",
            "0.005",
        ]
    )
    run_dir = newest_run(root)
    assert json.loads((run_dir / "throughput.json").read_text())["compiled"] is False
    assert hparams(run_dir)["learning_rate"] == 0.005
    events = EventAccumulator(str(run_dir))
    events.Reload()
    # The restored AdamW state trains on with the new rate, in both parameter groups.
    for group in ("lr-AdamW/pg1", "lr-AdamW/pg2"):
        rates = [e.value for e in events.Scalars(group)]
        assert rates and rates == pytest.approx([0.005] * len(rates))
    assert [e.step for e in events.Scalars("train/loss")] == [2, 3]  # continued from step 2


def test_the_checkpoint_fills_in_what_the_user_did_not_give(first_run, shakespeare, caplog):
    root, _, ckpt = first_run
    # No config file: architecture and data come from the checkpoint.
    main(
        [
            "fit",
            "--ckpt_path",
            str(ckpt),
            "--trainer.max_steps",
            "3",
            "--trainer.accelerator",
            "cpu",
            "--trainer.limit_val_batches",
            "0",
            "--model.compile",
            "false",
            "--trainer.logger.init_args.save_dir",
            str(root / "tb"),
            "--trainer.logger.init_args.name",
            "run",
        ]
    )
    saved = hparams(newest_run(root))
    assert (saved["n_layer"], saved["n_head"], saved["n_embd"], saved["block_size"]) == (1, 2, 32, 32)
    assert saved["learning_rate"] == 0.001  # the checkpoint's (the module default), nothing given now
    # Trained on the checkpoint's corpus, not on the default one.
    assert f"loaded {len(gpt2_encoding().encode_ordinary(shakespeare[:20_000]))} tokens" in caplog.text


def test_another_architecture_is_refused_with_the_difference_named(first_run, capsys):
    root, config, ckpt = first_run
    before = sorted((root / "tb" / "run").iterdir())
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fit",
                "--config",
                str(config),
                "--ckpt_path",
                str(ckpt),
                "--trainer.max_steps",
                "4",
                "--model.compile",
                "false",
                "--model.n_embd",
                "64",
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "n_embd: checkpoint 32, this model 64" in err and "Traceback" not in err
    after = sorted((root / "tb" / "run").iterdir())
    assert not (set(after) - set(before)) or all(
        not list(p.glob("checkpoints/*.ckpt")) for p in set(after) - set(before)
    )


def test_another_head_count_is_refused_though_no_shape_shows_it(first_run, capsys):
    root, config, ckpt = first_run
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "fit",
                "--config",
                str(config),
                "--ckpt_path",
                str(ckpt),
                "--trainer.max_steps",
                "3",
                "--model.compile",
                "false",
                "--model.n_head",
                "1",
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    (line,) = [line for line in err.splitlines() if line.startswith("gpt-lightning: error:")]
    assert "n_head: checkpoint 2, this model 1" in line and "Traceback" not in err


def test_dropout_is_a_training_setting_and_may_change_on_resume(first_run):
    root, config, ckpt = first_run
    main(
        [
            "fit",
            "--config",
            str(config),
            "--ckpt_path",
            str(ckpt),
            "--trainer.max_steps",
            "3",
            "--model.compile",
            "false",
            "--model.dropout",
            "0.1",
        ]
    )
    assert hparams(newest_run(root))["dropout"] == 0.1


def test_a_checkpoint_that_reached_max_steps_is_refused_in_one_line(first_run, capsys):
    """Resuming the finished run as the README shows, without raising max_steps, trained nothing and exited 0."""
    root, config, ckpt = first_run
    before = set((root / "tb" / "run").iterdir())
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--ckpt_path", str(ckpt)])
    assert exit_info.value.code == 2
    assert (
        f"Checkpoint {ckpt} is at step 2, and trainer.max_steps is 2: nothing is left to train. To train on, raise "
        "it, e.g. --trainer.max_steps 4." in capsys.readouterr().err
    )
    assert set((root / "tb" / "run").iterdir()) == before  # refused before any run folder is made


def test_ckpt_path_last_resumes_the_newest_run_of_this_logger(first_run, caplog):
    """Lightning's own "last" looks in the new run's empty folder and silently starts from step 0."""
    root, config, _ = first_run
    caplog.set_level("INFO")
    newest = newest_run(root)
    main(
        [
            "fit",
            "--config",
            str(config),
            "--ckpt_path",
            "last",
            "--model.compile",
            "false",
            "--trainer.max_steps",
            str(hparams_step(newest) + 1),
        ]
    )
    assert f"--ckpt_path last: resuming from {newest / 'checkpoints' / 'last.ckpt'}" in caplog.text
    run_dir = newest_run(root)
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [hparams_step(newest)]  # one step on from there


def test_ckpt_path_last_is_one_command_for_the_first_launch_and_every_requeue(first_run, caplog):
    """A job script runs the same line at its first launch and at every requeue: with no checkpoint
    yet it starts fresh (it refused, exit 2), and once the run reached max_steps it says so and exits
    0 (it refused too, exit 2), without making a run folder."""
    root, config, _ = first_run
    caplog.set_level("INFO")
    job = [
        "fit",
        "--config",
        str(config),
        "--ckpt_path",
        "last",
        "--model.compile",
        "false",
        "--trainer.logger.init_args.name",
        "job",
    ]
    main(job)
    assert (
        f"--ckpt_path last: no run under {root / 'tb' / 'job'} has a checkpoints/last.ckpt yet; starting fresh."
        in caplog.text
    )
    ckpt = root / "tb" / "job" / "version_0" / "checkpoints" / "last.ckpt"
    assert hparams_step(ckpt.parent.parent) == 2  # trained from scratch to max_steps
    caplog.clear()
    with pytest.raises(SystemExit) as exit_info:
        main(job)
    assert exit_info.value.code == 0
    assert (
        f"--ckpt_path last: {ckpt} is at step 2, trainer.max_steps is 2: this run is finished, nothing to do."
        in caplog.text
    )
    assert sorted(p.name for p in (root / "tb" / "job").iterdir()) == ["version_0"]


def hparams_step(run_dir):
    import torch

    return torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["global_step"]


def tiny_cpu_fit(tmp_path, shakespeare, *extra):
    """The tiny run on a small corpus, logging every step under tmp_path/tb."""
    (tmp_path / "c.txt").write_text(shakespeare[:20_000])
    return [
        *TINY_FIT,
        *tiny_flags(
            {
                "data.data_path": tmp_path / "c.txt",
                "data.cache_dir": tmp_path,
                "trainer.log_every_n_steps": 1,
                "trainer.logger.init_args.save_dir": tmp_path / "tb",
            }
        ),
        *extra,
    ]


def test_a_resumed_run_logs_at_the_steps_the_uninterrupted_run_logs_at(tmp_path, shakespeare):
    """Train 3 steps (validating at the last), resume to 6: the curve continues at step 3, as the
    6-step run's does. Lightning put it at 4 to 6: its restart guess is wrong for an end-of-fit checkpoint."""
    common = tiny_cpu_fit(
        tmp_path, shakespeare, "--trainer.limit_val_batches", "1", "--trainer.val_check_interval", "3"
    )
    main([*common, "--trainer.max_steps", "6", "--trainer.logger.init_args.name", "whole"])
    main([*common, "--trainer.max_steps", "3", "--trainer.logger.init_args.name", "short"])
    main(
        [
            *common,
            "--trainer.max_steps",
            "6",
            "--trainer.logger.init_args.name",
            "resumed",
            "--ckpt_path",
            str(tmp_path / "tb/short/version_0/checkpoints/last.ckpt"),
        ]
    )

    def curve(name, tag):
        events = EventAccumulator(str(tmp_path / "tb" / name / "version_0"))
        events.Reload()
        return [(e.step, e.value) for e in events.Scalars(tag)]

    assert curve("resumed", "train/loss") == curve("whole", "train/loss")[3:]
    assert curve("resumed", "val/loss") == curve("whole", "val/loss")[1:]


def test_ckpt_path_last_with_a_checkpoint_dirpath_is_lightning_s(tmp_path, shakespeare):
    """Checkpoints written to --checkpoint.dirpath are where Lightning's own `last` looks: left to it."""
    common = tiny_cpu_fit(
        tmp_path, shakespeare, "--trainer.limit_val_batches", "0", "--checkpoint.dirpath", str(tmp_path / "ckpts")
    )
    main([*common, "--trainer.max_steps", "2"])
    main([*common, "--trainer.max_steps", "3", "--ckpt_path", "last"])
    events = EventAccumulator(str(tmp_path / "tb" / "tiny-cpu" / "version_1"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2]  # resumed at step 2, not from scratch
