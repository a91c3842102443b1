"""A run stopped at a checkpoint and resumed through the CLI ends with the very weights of the run that
was never stopped (torch.equal), across epoch ends: with and without gradient accumulation (an epoch
is trimmed to whole optimizer steps), with limit_train_batches (rounded to whole steps), and with
shuffling, and with Lightning's weight EMA (the average and the trained weights both)."""

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ARCH_FLAGS, MODERN_FLAGS, TINY_FIT, tiny_flags
from lightning.pytorch import Callback

from gpt_lightning.cli import main

# configs/tiny-cpu.yaml as written (auto: bf16-mixed where the CPU has it), shrunk in size and steps; 11 batches an epoch.
TINY = [
    *TINY_FIT,
    *tiny_flags(
        {
            "data.val_fraction": 0,
            "trainer.log_every_n_steps": 1,
            "trainer.enable_progress_bar": False,
            "checkpoint.save_top_k": -1,
        }
    ),
]
EPOCH_TOKENS = 11 * 2 * 16 + 1  # 11 batches of 2 x 16, and the last target


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, shakespeare) -> Path:
    from gpt_lightning.data.tokenizer import gpt2_encoding

    enc = gpt2_encoding()
    ids = enc.encode_ordinary(shakespeare[:4000])[: EPOCH_TOKENS + 10]  # +10: not a whole batch more
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(enc.decode(ids))
    assert len(enc.encode_ordinary(path.read_text())) == EPOCH_TOKENS + 10
    return path


def shard_folder(corpus: Path, folder: Path) -> Path:
    from gpt_lightning.data.tokenizer import gpt2_encoding

    ids = np.array(gpt2_encoding().encode_ordinary(corpus.read_text()), dtype=np.uint16)
    folder.mkdir()
    for i, part in enumerate(np.array_split(ids, 3)):  # 124 tokens: 3 batches of 2 x 16 (+1) each
        np.save(folder / f"corpus_train_{i:06d}.npy", part)
    return folder


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """``state_dict``; with a weight EMA (the average) also the trained weights and the EMA's count."""
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    trained = {f"current_model_state/{k}": v for k, v in saved.get("current_model_state", {}).items()}
    return {**saved["state_dict"], **trained, **saved.get("averaging_state", {})}


def schedules(ckpt: Path) -> list[dict]:
    """Each scheduler's position and rates as saved (what get_last_lr() reports, too)."""
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)["lr_schedulers"]
    return [{key: state[key] for key in ("last_epoch", "base_lrs", "_last_lr")} for state in saved]


def fit_args(root: Path, name: str, corpus: Path, *args: str) -> list[str]:
    return [
        *TINY,
        "--data.data_path",
        str(corpus),
        "--data.cache_dir",
        str(root / "cache"),
        "--trainer.logger.init_args.save_dir",
        str(root),
        "--trainer.logger.init_args.name",
        name,
        *args,
    ]


def fit(root: Path, name: str, corpus: Path, *args: str) -> Path:
    main(fit_args(root, name, corpus, *args))
    (run,) = (root / name).iterdir()
    return run / "checkpoints"


# Checkpoints every `stop` steps; the run ends at 2 x stop, so both runs' last.ckpt are of that step.
@pytest.mark.parametrize(
    "stop, flags",
    [
        (11, []),  # stopped on an epoch's last batch; the resumed run ends on the next one's
        (
            4,
            ["--trainer.accumulate_grad_batches", "3"],
        ),  # 3+3+3 batches an epoch (2 left out): stopped 1 step into the second
        (4, ["--trainer.accumulate_grad_batches", "3", "--trainer.limit_train_batches", "7"]),  # rounded to 6: 3+3
        (5, ["--data.tokens_per_step", "96", "--data.shuffle", "true"]),  # accumulation 3, shuffled
        (4, ["--data.tokens_per_step", "96", "--data.shuffle", "true", "shards"]),  # 3 shards of 3 batches
        (
            4,
            [
                "--trainer.accumulate_grad_batches",
                "3",
                "--trainer.gradient_clip_val",
                "1.0",
                "--model.optimizer",
                "muon",
                "--model.lr_schedule",
                "wsd",
                "--model.warmup_steps",
                "2",
            ],
        ),  # Muon's buffers, the WSD decay across the stop
        (
            2,
            [
                "--trainer.accumulate_grad_batches",
                "3",
                "--model.optimizer",
                "muon",
                "--model.lr_schedule",
                "wsd",
                "--model.embedding_learning_rate",
                "0.1",
                "--model.head_learning_rate",
                "0.004",
                *MODERN_FLAGS,
                *ARCH_FLAGS,
                "--model.n_layer",
                "2",  # the SL pattern: a windowed block and the long last one
                "--model.window_pattern",
                "SL",
            ],
        ),  # the modern model's groups, and a windowed block (sliding-window attention), the scalars between its blocks
        (
            4,
            [
                "--trainer.precision",
                "32-true",
                "--model.optimizer",
                "muon",
                "--trainer.callbacks+=EMAWeightAveraging",
                "--trainer.callbacks.decay",
                "0.5",
            ],
        ),  # Lightning's weight EMA: the average (state_dict), the trained weights and the count
    ],
    ids=[
        "epoch-end",
        "accumulation",
        "limit_train_batches",
        "shuffled",
        "shuffled-shards",
        "muon-wsd",
        "modern",
        "ema",
    ],
)
def test_resumed_run_ends_with_the_weights_of_the_uninterrupted_one(tmp_path, corpus, stop, flags):
    if flags and flags[-1] == "shards":  # the corpus's tokens as a shard folder: the shard order is shuffled too
        flags, corpus = flags[:-1], shard_folder(corpus, tmp_path / "shards")
    every = [
        "--checkpoint.every_n_train_steps",
        str(stop),
        "--checkpoint.save_top_k",
        "-1",
        "--trainer.max_steps",
        str(2 * stop),
    ]
    whole = fit(tmp_path, "whole", corpus, *flags, *every)
    (at_stop,) = whole.glob(f"*step={stop}.ckpt")
    resumed = fit(tmp_path, "resumed", corpus, *flags, *every, "--ckpt_path", str(at_stop))
    expected, got = weights(whole / "last.ckpt"), weights(resumed / "last.ckpt")
    assert schedules(resumed / "last.ckpt") == schedules(whole / "last.ckpt")
    assert expected.keys() == got.keys()
    if "--trainer.callbacks+=EMAWeightAveraging" in flags:
        assert expected["n_averaged"] == 2 * stop and not torch.equal(
            expected["model.transformer.wte.weight"], expected["current_model_state/model.transformer.wte.weight"]
        )
    differ = [k for k in expected if not torch.equal(expected[k], got[k])]
    assert not differ, (
        f"{len(differ)} tensors differ, e.g. {differ[0]}: max |diff| "
        f"{(expected[differ[0]].float() - got[differ[0]].float()).abs().max():.3g}"
    )


class Killed(Exception):
    """A kill's stand-in: nothing of the run's own stop handling reacts to it."""


class KilledInTheSecondMicroBatch(Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == 2 and batch_idx % 2 == 1:
            raise Killed


def test_a_launch_killed_in_its_first_step_resumes_from_the_step_it_started_from(tmp_path, corpus):
    """Resumed at step 2 (a multiple of every_n_train_steps), 2 micro-batches a step, killed in the second
    micro-batch: the next launch resumes from step 2's checkpoint, at the uninterrupted run's weights. Before,
    Lightning's ModelCheckpoint saved step 2 again after the first micro-batch, mid-step (it keeps the step it
    saved in memory only), and the next launch resumed from that one micro-batch late (the fault mixture's seed 13)."""
    every = ["--data.tokens_per_step", "64", "--checkpoint.every_n_train_steps", "2", "--trainer.max_steps"]
    whole = fit(tmp_path, "whole", corpus, *every, "4")
    job = fit_args(tmp_path, "job", corpus, *every, "4", "--ckpt_path", "last")
    main([*job, "--trainer.max_steps", "2"])  # version_0: step 2
    with pytest.raises(Killed):
        main([*job, "--trainer.callbacks+=test_resume_exact.KilledInTheSecondMicroBatch"])  # version_1
    assert not list((tmp_path / "job" / "version_1").rglob("*.ckpt"))
    main(job)  # version_2, from version_0's step 2
    expected, got = weights(whole / "last.ckpt"), weights(tmp_path / "job" / "version_2" / "checkpoints" / "last.ckpt")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
