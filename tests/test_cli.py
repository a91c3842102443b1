"""Every shipped YAML parses, and `gpt-lightning fit` runs and logs to TensorBoard."""

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_FIT, tiny_flags
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gpt_lightning.cli import main
from gpt_lightning.data.tokenizer import gpt2_encoding
from gpt_lightning.lightning_cli import GPTLightningCLI
from gpt_lightning.model import GPT, GPTConfig
from gpt_lightning.scaling.memory import GIB, training_memory
from gpt_lightning.training.precision import fast_precision

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


class ParseOnlyCLI(GPTLightningCLI):
    def instantiate_classes(self) -> None:  # parse and validate, build nothing
        pass


def test_configs_exist():
    assert {p.name for p in CONFIGS} >= {"gpt2-124m.yaml", "tiny-cpu.yaml"}


OVERLAYS = {"fsdp2.yaml"}  # given after a model config: they set only what they are about


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses(config):
    base = ["--config", str(REPO / "configs/gpt2-xl.yaml")] if config.name in OVERLAYS else []
    cli = ParseOnlyCLI(run=False, args=[*base, "--config", str(config)])
    cfg = cli.config
    if config.name == "fsdp2.yaml":
        assert cfg.trainer.strategy.class_path == "gpt_lightning.scaling.swapped_checkpoints.SwappedCheckpointStrategy"
        assert cfg.model.n_layer == 48  # the model config's settings stay
        assert cfg.trainer.inference_mode is False  # validation under no_grad on NCCL too
    # The position table follows the data's T, except a pretrained model's, which keeps its own.
    assert cfg.model.block_size == (None if cfg.model.init_from else cfg.data.block_size)
    # The CPU configs ask for the precision that is fast where they run (bf16-mixed only where bf16 is native).
    assert cfg.trainer.precision == ("auto" if cfg.trainer.accelerator == "cpu" else "bf16-mixed")
    assert cfg.model.compile is True
    assert cfg.trainer.logger.init_args.save_dir == "logs"


def test_reference_config_is_the_reference_experiment():
    cfg = ParseOnlyCLI(run=False, args=["--config", str(REPO / "configs/gpt2-124m.yaml")]).config
    assert (cfg.data.batch_size, cfg.data.block_size, cfg.trainer.max_steps) == (16, 1024, 100)
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.vocab_size) == (12, 12, 768, 50257)
    assert cfg.model.learning_rate == 1e-3 and cfg.model.float32_matmul_precision == "high"
    assert cfg.model.compile_scope == "model"  # torch.compile(model), as the notes ran it
    assert cfg.trainer.accelerator == "cuda" and cfg.seed_everything == 42


def run_cli(*args: str, cwd: Path, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "gpt_lightning", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


# The tiny run with the quick start's compile and validation samples as written, compiled at its precision (auto): the
# suite's one tiny compiled shape (1 layer of width 32, batches of 2 x 32 tokens), whose kernels the compile cache shares.
SHRUNK = {"model.compile": None, "model.val_sample_tokens": None, "data.block_size": 32}


def test_fit_on_the_tiny_config_writes_tensorboard_events(cache_dir, tmp_path):
    result = run_cli(
        *TINY_FIT,
        *tiny_flags(
            {
                **SHRUNK,
                "trainer.max_steps": 6,
                "trainer.log_every_n_steps": 2,
                "trainer.val_check_interval": 3,
                "trainer.limit_val_batches": 1,
                "throughput.warmup_steps": 2,
                "trainer.logger.init_args.save_dir": tmp_path / "tb",
            }
        ),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    console = result.stdout + result.stderr
    assert "loaded 338025 tokens" in console
    # (338025 - 33802 validation tokens - 1) // (2 x 32): the batches one epoch really trains.
    assert "1 epoch = 4753 batches" in console
    # A clean console: our step counter and FLOPs, no tips, no warnings the user cannot act on.
    assert "step: 100%" in console and "6/6" in console and "Epoch 0" not in console
    assert "Training FLOPs per batch (forward + backward)" in console and "Total Flops" not in console
    # The memory estimate of this run: 1 x 32 model, 2 x 32 tokens, one process, at the precision auto chose.
    precision = fast_precision("cpu")[0]
    mixed = precision == "bf16-mixed"
    assert f"precision auto: {precision} (this CPU " in console
    memory = training_memory(
        GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=32), 2, 32, ddp=False, precision=precision
    )
    assert (
        f"{memory.total / GIB:.2f} GiB per device, estimated (eager; the memory guide, docs/multi-gpu.md): "
        f"{memory.weights_grads_optimizer / GIB:.2f} weights, gradients and optimizer states + "
        + (f"{memory.bf16_weight_copies / GIB:.2f} half-precision weight copies (autocast's) + " if mixed else "")
        + f"{memory.activations / GIB:.2f} activations of 64 tokens"
    ) in console
    # The docs quote the estimate of the quick start as written: 4 x 128 model, 8 x 128 tokens.
    from test_readme import DOCS_TEXT

    cfg = ParseOnlyCLI(run=False, args=["--config", str(REPO / "configs/tiny-cpu.yaml")]).config
    config = GPTConfig(
        n_layer=cfg.model.n_layer, n_head=cfg.model.n_head, n_embd=cfg.model.n_embd, block_size=cfg.model.block_size
    )
    quick_start = training_memory(config, cfg.data.batch_size, cfg.data.block_size, ddp=False)
    assert f"`{quick_start.total / GIB:.2f} GiB per device,\nestimated ...` for the quick start" in DOCS_TEXT
    for noise in ("Tip:", "LeafSpec", "not supported by the model summary", "Warning", "Traceback"):
        assert noise not in console, noise
    run_dirs = list((tmp_path / "tb" / "tiny-cpu").iterdir())
    assert len(run_dirs) == 1
    assert [p.name for p in (run_dirs[0] / "checkpoints").iterdir()] == ["last.ckpt"]  # one copy, not two
    events = EventAccumulator(str(run_dirs[0]))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {
        "train/loss",
        "val/loss",
        "val/perplexity",
        "throughput/tokens_per_sec",
        "throughput/step_ms",
        "lr-AdamW/pg1",
        "lr-AdamW/pg2",
        "throughput/first_step_s",
        "throughput/warmup_s",
        "train/grad_norm",
    } <= set(tags)
    assert all(0 < e.value < 1e3 for e in events.Scalars("train/grad_norm"))
    # Once-only values appear once, not at every logging step.
    assert len(events.Scalars("throughput/first_step_s")) == len(events.Scalars("throughput/warmup_s")) == 1
    losses = [e.value for e in events.Scalars("train/loss")]
    assert len(losses) == 3 and all(0 < v < 12 for v in losses)
    assert any(tag.startswith("samples") for tag in events.Tags()["tensors"])  # text logged at validation
    assert (run_dirs[0] / "checkpoints" / "last.ckpt").is_file()
    assert (run_dirs[0] / "throughput.json").is_file()


def test_a_small_corpus_with_epochs_shorter_than_the_validation_interval(
    shakespeare, tmp_path, monkeypatch, caplog, capfd, recwarn, in_process_group
):
    text = shakespeare[:2_000]
    (tmp_path / "small.txt").write_text(text)
    n = len(gpt2_encoding().encode_ordinary(text))
    epoch = (n - int(n * 0.5) - 1) // (2 * 64)
    assert 0 < epoch < 5  # shorter than the validation interval below
    monkeypatch.chdir(tmp_path)
    caplog.set_level("INFO")
    main(
        [  # in this process, as the `gpt-lightning` script calls it
            *TINY_FIT,
            *tiny_flags(
                {
                    "data.data_path": "small.txt",
                    "data.block_size": 64,
                    "data.val_fraction": 0.5,
                    "trainer.max_steps": 7,
                    "trainer.val_check_interval": 5,
                    "trainer.log_every_n_steps": 3,
                    "trainer.limit_val_batches": 1,
                    "trainer.logger.init_args.save_dir": tmp_path / "tb",
                }
            ),
        ]
    )
    out, err = capfd.readouterr()
    console = caplog.text + out + err + "".join(str(warning.message) for warning in recwarn)  # all the user would see
    assert f"1 epoch = {epoch} batches" in console
    assert "logging interval" not in console
    (run_dir,) = (tmp_path / "tb" / "tiny-cpu").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    assert [e.step for e in events.Scalars("val/loss")] == [5]  # after optimizer step 5, across epochs
    assert len(events.Scalars("train/loss")) == 2  # steps 3 and 6, across epoch ends


def test_the_fast_config_is_the_reference_plus_only_its_speed_choices():
    def flat(cfg, prefix=""):
        out = {}
        for key, value in cfg.items():
            if hasattr(value, "items"):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    reference = flat(ParseOnlyCLI(run=False, args=["--config", str(REPO / "configs/gpt2-124m.yaml")]).config)
    fast = flat(ParseOnlyCLI(run=False, args=["--config", str(REPO / "configs/gpt2-124m-fast.yaml")]).config)
    changed = {key for key in reference.keys() | fast.keys() if reference.get(key) != fast.get(key)}
    assert changed == {"model.vocab_size", "model.compile_scope", "trainer.logger.init_args.name", "config"}
    assert (fast["model.vocab_size"], fast["model.compile_scope"]) == (50304, "blocks")
    for lever in ("model.chunked_loss", "model.cudnn_attention"):  # the module's defaults in both
        assert fast[lever] == reference[lever] and not fast[lever], lever


@pytest.mark.parametrize(
    ("name", "published"),
    [
        ("gpt2-124m.yaml", 124_439_808),
        ("gpt2-medium.yaml", 354_823_168),
        ("gpt2-large.yaml", 774_030_080),
        ("gpt2-xl.yaml", 1_557_611_200),
    ],
)
def test_gpt2_family_configs_have_the_published_parameter_counts(name, published):
    model_args = ParseOnlyCLI(run=False, args=["--config", str(REPO / "configs" / name)]).config.model
    with torch.device("meta"):  # no memory: only the shapes count
        model = GPT(GPTConfig(**{f.name: model_args[f.name] for f in fields(GPTConfig)}))
    assert model.num_parameters() == published
