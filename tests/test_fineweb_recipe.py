"""configs/gpt2-124m-fineweb.yaml, build-nanogpt's recipe: refused without a shard folder (saying how
to make one), and run on a CPU with tiny overrides on shards the test writes."""

import pytest
import yaml
from conftest import REPO, tiny_flags
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gpt_lightning.cli import main

RECIPE = str(REPO / "configs" / "gpt2-124m-fineweb.yaml")
# Its precision (bf16-mixed) and clipping as written: clipping under bf16-mixed once died at step 1.
TINY = tiny_flags({"trainer.accelerator": "cpu"})


def test_without_a_shard_folder_it_says_how_to_make_one(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no edu_fineweb10B here
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", RECIPE, *TINY, "--trainer.logger.init_args.save_dir", str(tmp_path / "tb")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "edu_fineweb10B does not exist" in err and "gpt-lightning tokenize" in err and "Traceback" not in err


def test_the_recipe_trains_on_shards(shakespeare, tmp_path, caplog):
    (tmp_path / "texts").mkdir()
    (tmp_path / "texts" / "a.txt").write_text(shakespeare[:60_000])
    main(
        ["tokenize", "--input", str(tmp_path / "texts"), "--output", str(tmp_path / "shards"), "--shard_tokens", "4000"]
    )
    main(
        [
            "fit",
            "--config",
            RECIPE,
            *TINY,
            "--data.data_path",
            str(tmp_path / "shards"),
            "--data.tokens_per_step",
            "128",
            "--trainer.max_steps",
            "4",
            "--model.warmup_steps",
            "2",
            "--model.cosine_decay_steps",
            "2",
            "--trainer.val_check_interval",
            "2",
            "--trainer.limit_val_batches",
            "1",
            "--trainer.log_every_n_steps",
            "1",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "tb"),
        ]
    )
    assert "128 tokens per optimizer step = 1 process(es) x 2 x 16 x 4 accumulated micro-batches" in caplog.text
    (run_dir,) = (tmp_path / "tb" / "gpt2-124m-fineweb").iterdir()
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["trainer"]["gradient_clip_val"] == 1.0
    assert (config["model"]["betas"], config["model"]["weight_decay"]) == ([0.9, 0.95], 0.1)
    events = EventAccumulator(str(run_dir))
    events.Reload()
    # The monitor writes the rate once per micro-batch (4 a step here): one rate per optimizer step.
    rates = dict(sorted({e.step: round(e.value / 6e-4, 4) for e in events.Scalars("lr-AdamW/pg1")}.items()))
    assert list(rates.values()) == [0.5, 1.0, 1.0, 0.55]  # warm-up over 2 steps, then cosine toward 10%
    assert {"train/grad_norm", "val/loss"} <= set(events.Tags()["scalars"])
