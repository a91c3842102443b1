"""data.tokens_per_step: the accumulation is derived from it, and one process accumulating 4
micro-batches, two DDP processes accumulating 2, and one process with a 4x batch train the same
weights from the same tokens (fp32, CPU), all through the CLI."""

import os

import pytest
import torch
from conftest import REPO, TINY_FIT, tiny_flags
from test_cli import run_cli

from gpt_lightning.cli import main

TINY = tiny_flags({"trainer.precision": "32-true", "data.val_fraction": 0, "trainer.max_steps": 3})


def fit(tmp_path, small_text, name, *extra, processes=1, caplog=None):
    """One process trains in the pytest process (main(), as `gpt-lightning` calls it); two are a
    real launch of `gpt-lightning` under Lightning's DDP launcher."""
    args = [
        *TINY_FIT,
        *TINY,
        "--data.data_path",
        str(small_text),
        "--trainer.logger.init_args.save_dir",
        str(tmp_path / "tb"),
        "--trainer.logger.init_args.name",
        name,
        *extra,
    ]
    if processes == 1:
        caplog.clear()
        main(args)
        log = caplog.text
    else:
        result = run_cli(
            *args,
            "--trainer.strategy",
            "ddp",
            "--trainer.devices",
            str(processes),
            "--trainer.accelerator",
            "cpu",
            cwd=tmp_path,
            env_extra={"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        log = result.stdout + result.stderr
    ckpt = next((tmp_path / "tb" / name).rglob("last.ckpt"))
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"], log


def test_accumulation_ddp_and_a_bigger_batch_train_the_same_weights(small_text, tmp_path, caplog):
    """Across epoch ends too: limit_train_batches makes every step an epoch of its own, and a limit
    that is no whole number of steps is rounded down (it trained 4 + 2 + 4 micro-batches, the 2
    divided by 4 as if they were 4, and on each DDP rank 2 + 1 + 2)."""
    caplog.set_level("INFO")
    accumulated, log = fit(
        tmp_path,
        small_text,
        "accumulate",
        "--data.tokens_per_step",
        "128",
        "--trainer.limit_train_batches",
        "6",
        caplog=caplog,
    )
    assert "128 tokens per optimizer step = 1 process(es) x 2 x 16 x 4 accumulated micro-batches" in log
    assert (
        "trainer.limit_train_batches 6 rounded down to 4, a whole number of optimizer steps of 4 micro-batches" in log
    )
    big, _ = fit(
        tmp_path, small_text, "big", "--data.batch_size", "8", "--trainer.limit_train_batches", "1", caplog=caplog
    )
    ddp, log = fit(
        tmp_path,
        small_text,
        "ddp",
        "--data.tokens_per_step",
        "128",
        "--trainer.limit_train_batches",
        "3",
        processes=2,
    )
    assert "128 tokens per optimizer step = 2 process(es) x 2 x 16 x 2 accumulated micro-batches" in log
    assert "trainer.limit_train_batches 3 rounded down to 2" in log
    for key, value in big.items():
        torch.testing.assert_close(accumulated[key], value, rtol=0, atol=1e-5, msg=key)
        torch.testing.assert_close(ddp[key], value, rtol=0, atol=1e-5, msg=key)


def test_tokens_per_step_that_does_not_divide_says_what_would(small_text, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                *TINY_FIT,
                *TINY,
                "--data.data_path",
                str(small_text),
                "--data.tokens_per_step",
                "100",
                "--trainer.logger.init_args.save_dir",
                str(tmp_path / "tb"),
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert (
        "data.tokens_per_step 100 is not a multiple of world_size x batch_size x block_size = 1 x 2 x 16 = 32. Use 96 or 128"
        in err
    )


def test_a_step_smaller_than_one_micro_batch_names_the_smallest(small_text, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(
            [
                *TINY_FIT,
                *TINY,
                "--data.data_path",
                str(small_text),
                "--data.tokens_per_step",
                "20",
                "--trainer.logger.init_args.save_dir",
                str(tmp_path / "tb"),
            ]
        )
    assert "= 32. Use 32, or change data.batch_size." in capsys.readouterr().err


def test_with_tokens_per_step_the_validation_interval_counts_optimizer_steps(small_text, tmp_path, caplog):
    """tiny-cpu.yaml as written (bf16-mixed, its clipping), accumulating 4 micro-batches a step:
    val_check_interval 2 validates after optimizer steps 2 and 4, not every 2 micro-batches (Lightning's
    count, which the FineWeb recipe's `250  # optimizer steps` would have meant every 31 steps on one GPU)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    caplog.set_level("INFO")
    main(
        [
            *TINY_FIT,
            *tiny_flags(
                {
                    "data.data_path": small_text,
                    "data.tokens_per_step": 128,
                    "trainer.max_steps": 4,
                    "trainer.val_check_interval": 2,
                    "trainer.limit_val_batches": 1,
                    "trainer.log_every_n_steps": 1,
                    "trainer.logger.init_args.save_dir": tmp_path / "tb",
                }
            ),
        ]
    )
    assert "validation every 2 optimizer steps = 8 micro-batches" in caplog.text
    (run_dir,) = (tmp_path / "tb").glob("*/version_0")
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [event.step for event in events.Scalars("val/loss")] == [
        2,
        4,
    ]  # after optimizer steps 2 and 4 (the steps done, as eval/*)
    assert [event.step for event in events.Scalars("train/loss")] == [0, 1, 2, 3]  # one per optimizer step


def test_a_batch_limit_under_one_optimizer_step_is_refused_in_one_line(small_text, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                *TINY_FIT,
                *TINY,
                "--data.data_path",
                str(small_text),
                "--data.tokens_per_step",
                "128",
                "--trainer.limit_train_batches",
                "3",
                "--trainer.logger.init_args.save_dir",
                str(tmp_path / "tb"),
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert (
        "trainer.limit_train_batches 3 is less than one optimizer step of 4 micro-batches: use 4 or a multiple of it."
        in err
    )


@pytest.mark.parametrize("source", ["text", "shards"])
def test_every_optimizer_step_trains_the_whole_budget_across_epoch_ends(source, shakespeare, tmp_path, caplog):
    """tiny-cpu.yaml as written (bf16-mixed, its clipping), 3 micro-batches a step over epochs of 11
    batches (a text; two shards of 5 and 6): each epoch is 9 batches, 3 whole steps, where Lightning
    ended each with a step of 2 micro-batches, each still divided by 3. Validation every 2 steps stays
    at step ends across epochs (it drifted into accumulations), and throughput.json reports every
    step's tokens (it looked at the first step only)."""
    import json

    import numpy as np
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from gpt_lightning.data.tokenizer import gpt2_encoding

    enc = gpt2_encoding()
    ids = enc.encode_ordinary(shakespeare[:4000])
    if source == "text":  # 470 tokens, the last 117 held out: 353 train 11 batches of 2 x 16 (and the last target)
        data = tmp_path / "corpus.txt"
        data.write_text(enc.decode(ids[:470]))
        assert len(enc.encode_ordinary(data.read_text())) == 470
    else:
        data = tmp_path / "shards"
        data.mkdir()
        np.save(data / "c_val_000000.npy", np.array(ids[:117], dtype=np.uint16))
        np.save(data / "c_train_000001.npy", np.array(ids[117 : 117 + 5 * 32 + 1], dtype=np.uint16))  # 5 batches
        np.save(data / "c_train_000002.npy", np.array(ids[300 : 300 + 6 * 32 + 1], dtype=np.uint16))  # 6
    caplog.set_level("INFO")
    caplog.clear()
    main(
        [
            *TINY_FIT,
            *tiny_flags(
                {
                    "data.data_path": data,
                    "data.val_fraction": 0.25,
                    "data.tokens_per_step": 96,
                    "data.cache_dir": tmp_path / "cache",
                    "trainer.max_steps": 7,
                    "trainer.val_check_interval": 2,
                    "trainer.limit_val_batches": 1,
                    "throughput.warmup_steps": 1,
                    "trainer.logger.init_args.save_dir": tmp_path / "tb",
                }
            ),
        ]
    )
    (run_dir,) = (tmp_path / "tb" / "tiny-cpu").iterdir()
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    position = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]  # the stream's own count
    assert (position["epoch"], position["batches"]) == (2, 3)  # 3 + 3 steps, then 1 of the third epoch
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("val/loss")] == [2, 4, 6]  # after optimizer steps 2, 4 and 6
    saved = json.loads((run_dir / "throughput.json").read_text())
    assert saved["tokens_per_optimizer_step"] == saved.get("tokens_per_optimizer_step_min") == 96
    assert saved["tokens_per_optimizer_step_max"] == 96 and saved["tokens_trained"] == 7 * 96
    assert "96 tokens per optimizer step)" in caplog.text
    assert (
        "1 epoch = 9 batches = 3 optimizer steps of 3 (2 of 11 batches left out so that no step is short)"
        in caplog.text
    )
