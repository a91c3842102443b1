"""--trainer.gradient_clip_val clips by global norm (or by value) on the device, for every precision
we ship, with fused AdamW kept: Lightning's own clipping refuses fused optimizers under *-mixed."""

import json

import pytest
from conftest import REPO, TINY_FIT, TINY_MODEL, tiny_flags
from grad_probes import ClipProbe
from lightning.pytorch import Trainer
from lightning.pytorch.plugins import MixedPrecision

from gpt_lightning import GPTLightningModule, TokenStreamDataModule
from gpt_lightning.cli import main

FSDP2 = ["--config", str(REPO / "configs" / "fsdp2.yaml"), "--trainer.devices", "1"]


def fit_tiny_config(small_text, tmp_path, *extra):
    """configs/tiny-cpu.yaml (compiled), shrunk in size and steps, in bf16-mixed on every CPU: Lightning's
    refusal of clipping with a fused optimizer is a mixed-precision one (its auto is float32 where bf16 is emulated)."""
    out = tmp_path / "clip.json"
    probe = {"class_path": "grad_probes.ClipProbe", "init_args": {"out": str(out)}}
    main(
        [
            *TINY_FIT,
            *tiny_flags(
                {
                    "model.compile": None,  # compiled, as the config has it
                    "data.data_path": small_text,
                    "data.block_size": 32,
                    "trainer.max_steps": 3,
                    "trainer.log_every_n_steps": 1,
                    "checkpoint.every_n_train_steps": 1000,
                    "throughput.warmup_steps": 1,
                    "trainer.logger.init_args.save_dir": tmp_path / "tb",
                }
            ),
            f"--trainer.callbacks+={json.dumps(probe)}",
            "--trainer.precision",
            "bf16-mixed",
            *extra,
        ]
    )
    return json.loads(out.read_text())["steps"]


def assert_clipped_by_norm(steps, clip):
    assert len(steps) == 3 and all(step["fused"] for step in steps)
    assert all(step["pre_norm"] > clip for step in steps)  # clipping had work to do
    for step in steps:  # x min(1, clip / (norm + 1e-6)), the norm measured independently
        assert step["post_norm"] == pytest.approx(
            min(1.0, clip / (step["pre_norm"] + 1e-6)) * step["pre_norm"], rel=1e-5
        )


@pytest.mark.parametrize("overlay", [[], FSDP2], ids=["as-written", "fsdp2"])
def test_clip_by_norm_on_the_tiny_config(overlay, small_text, tmp_path, in_process_group):
    """The README's flag on the config as written: before, Lightning raised "does not allow for
    gradient clipping ... 'fused' optimizer?" at the first step. Under the FSDP2 overlay the
    gradients are DTensor shards (uncompiled there: compile is the other case's)."""
    extra = [*overlay, "--model.compile", "false"] if overlay else []
    assert_clipped_by_norm(fit_tiny_config(small_text, tmp_path, "--trainer.gradient_clip_val", "1.0", *extra), 1.0)


def test_clip_by_value_on_the_tiny_config(small_text, tmp_path):
    steps = fit_tiny_config(
        small_text,
        tmp_path,
        "--model.compile",
        "false",
        "--trainer.gradient_clip_val",
        "0.05",
        "--trainer.gradient_clip_algorithm",
        "value",
    )
    assert len(steps) == 3 and all(step["fused"] for step in steps)
    for step in steps:
        assert step["pre_max"] > 0.05  # some element was over the bound, and none is now
        assert step["post_max"] == pytest.approx(0.05)
        assert step["post_norm"] < step["pre_norm"]


@pytest.mark.parametrize("algorithm, clip", [("norm", 1.0), ("value", 0.05)])
def test_clipping_under_16_mixed_clips_the_unscaled_gradients(algorithm, clip, small_text, tmp_path):
    """16-mixed with fused AdamW: Lightning leaves the gradients multiplied by the GradScaler's scale
    (the fused step unscales them), so the clip must apply to gradient / scale. On CPU the
    precision flag turns 16-mixed into bf16-mixed; the plugin keeps fp16 and its GradScaler."""
    module = GPTLightningModule(**TINY_MODEL)
    data = TokenStreamDataModule(
        str(small_text), batch_size=2, block_size=32, val_fraction=0.0, cache_dir=str(tmp_path)
    )
    trainer = Trainer(
        accelerator="cpu",
        plugins=[MixedPrecision("16-mixed", "cpu")],
        max_steps=3,
        gradient_clip_val=clip,
        gradient_clip_algorithm=algorithm,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ClipProbe(str(tmp_path / "clip.json"))],
    )
    trainer.fit(module, data)
    steps = json.loads((tmp_path / "clip.json").read_text())["steps"]
    assert all(step["scale"] > 1 for step in steps)  # the gradients were scaled at clipping time
    if algorithm == "norm":
        assert_clipped_by_norm(steps, clip)
    else:
        assert all(step["pre_max"] > clip and step["post_max"] == pytest.approx(clip) for step in steps)
