"""data.tokens_per_step_schedule: steps of 2 micro-batches, then of 4, train the very weights of a run
of 2 steps at data.tokens_per_step 64 resumed at 128 (the same windows, grouped the same), the tokens
they come to are said at the start and counted by the throughput callback; bad schedules are refused
in one line. Its exact resume across a stage boundary: tests/test_resume_exact.py."""

import json
import re

import pytest
import torch
from conftest import REPO
from test_tokens_per_step import TINY

from gpt_lightning.cli import main


def fit(tmp_path, small_text, name, *extra):
    main(
        [
            "fit",
            "--config",
            str(REPO / "configs/tiny-cpu.yaml"),
            *TINY,
            "--data.data_path",
            str(small_text),
            "--data.batch_size",
            "2",
            "--throughput.warmup_steps",
            "1",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "tb"),
            "--trainer.logger.init_args.name",
            name,
            *extra,
        ]
    )
    (run,) = sorted((tmp_path / "tb" / name).iterdir())[-1:]
    return run


def test_a_schedule_trains_the_weights_of_the_same_steps_run_by_hand(small_text, tmp_path, caplog):
    caplog.set_level("INFO")
    caplog.clear()
    scheduled = fit(
        tmp_path,
        small_text,
        "scheduled",
        "--data.tokens_per_step_schedule",
        "[[0, 64], [2, 128]]",
        "--trainer.max_steps",
        "4",
    )
    assert (
        "tokens per optimizer step: 64 (x 2 micro-batches) from step 0, 128 (x 4) from step 2, micro-batches of "
        "1 process(es) x 2 x 16; trainer.max_steps 4 = 384 tokens" in caplog.text
    )
    epoch = re.search(
        r"1 epoch = (\d+) batches = (\d+) x 4 micro-batches \(4: a whole number of optimizer steps", caplog.text
    )
    assert epoch and int(epoch[1]) == 4 * int(epoch[2]), caplog.text  # the lcm of 2 and 4 micro-batches a step
    saved = json.loads((scheduled / "throughput.json").read_text())
    assert (saved["tokens_per_optimizer_step_min"], saved["tokens_per_optimizer_step_max"]) == (64, 128)
    assert saved["tokens_trained"] == 384
    first = fit(tmp_path, small_text, "by-hand", "--data.tokens_per_step", "64", "--trainer.max_steps", "2")
    ckpt = str(first / "checkpoints" / "last.ckpt")
    then = fit(
        tmp_path,
        small_text,
        "by-hand",
        "--data.tokens_per_step",
        "128",
        "--trainer.max_steps",
        "4",
        "--ckpt_path",
        ckpt,
    )
    expected = torch.load(then / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    got = torch.load(scheduled / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    differ = [key for key in expected if not torch.equal(expected[key], got[key])]
    assert not differ, f"{len(differ)} tensors differ, e.g. {differ[0]}"


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--data.tokens_per_step_schedule", "[[0, 32], [3, 128]]"],
            "data.tokens_per_step_schedule: the stage from step 0 (1 micro-batches a step) lasts 3 steps, not a "
            "multiple of 4: each stage but the last must train a multiple of 4 micro-batches",
        ),
        (["--data.tokens_per_step_schedule", "[[0, 64], [4, 100]]"], "Use 96 or 128, or change data.batch_size."),
        (["--data.tokens_per_step_schedule", "[[2, 64]]"], "data.tokens_per_step_schedule must start at step 0"),
        (["--data.tokens_per_step_schedule", "[[0, 64], [8, 128], [8, 64]]"], "steps must increase: 8 follows 8"),
        (
            ["--data.tokens_per_step_schedule", "[[0, 64]]", "--data.tokens_per_step", "64"],
            "Give data.tokens_per_step or data.tokens_per_step_schedule, not both",
        ),
        (
            ["--data.tokens_per_step_schedule", "[[0, 64]]", "--trainer.max_steps", "-1", "--trainer.max_epochs", "1"],
            "data.tokens_per_step_schedule needs trainer.max_steps",
        ),
    ],
    ids=["unaligned-stage", "not-a-multiple", "not-from-0", "not-increasing", "both", "no-max_steps"],
)
def test_a_bad_schedule_is_refused_in_one_line(small_text, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        fit(tmp_path, small_text, "bad", *flags)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_mid_epoch_resume_under_another_schedule_is_refused():
    import numpy as np

    from gpt_lightning.data.windows import TokenWindows
    from gpt_lightning.errors import UserError

    tokens = np.arange(20 * 32 + 1, dtype=np.uint16)
    saved = TokenWindows(tokens, 2, 16, accumulate=4, schedule=[(0, 64), (2, 128)])
    batches = saved.__iter__()
    for _ in range(4):
        next(batches)
    state = saved.state_dict()
    other = TokenWindows(tokens, 2, 16, accumulate=4, schedule=[(0, 64), (4, 128)])
    with pytest.raises(UserError, match="stopped mid-epoch with data.tokens_per_step_schedule"):
        other.load_state_dict(state)
    TokenWindows(tokens, 2, 16, accumulate=4, schedule=[(0, 64), (2, 128)]).load_state_dict(state)  # its own: goes on
