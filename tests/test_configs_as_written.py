"""Every file in configs/ trains AS WRITTEN: its precision, clipping, schedule, accumulation
(tokens_per_step), compile and strategy untouched, shrunk only in device (cuda -> cpu), size
(n_layer / n_head / n_embd, block_size), batch, steps and the logging and validation intervals.
The FineWeb recipe trains on shards this test writes (tokens_per_step shrunk with the batch, so the
accumulation stays the recipe's 8), the fine-tune config on a small GPT-2 saved by `transformers`,
and the FSDP2 overlay goes on top of gpt2-xl.yaml, as the README shows it, in one CPU process."""

import json

import pytest
import yaml
from conftest import REPO
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gpt_lightning.cli import main
from gpt_lightning.interop.checkpoint import gpt_from_checkpoint
from gpt_lightning.training.precision import fast_precision

CONFIGS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
OVERLAYS = {"fsdp2.yaml": "gpt2-xl.yaml"}  # overlay -> the model config the README gives it after
STEPS = 2
SHRINK = [
    "--trainer.accelerator",
    "cpu",
    "--model.n_layer",
    "1",
    "--model.n_head",
    "2",
    "--model.n_embd",
    "32",
    "--data.batch_size",
    "2",
    "--data.block_size",
    "32",
    "--trainer.max_steps",
    str(STEPS),
    "--trainer.log_every_n_steps",
    "1",
    "--throughput.warmup_steps",
    "1",
]
# What a test must never override: the settings that decide whether a real run works.
AS_WRITTEN = {
    "trainer": ("precision", "gradient_clip_val", "gradient_clip_algorithm", "accumulate_grad_batches", "strategy"),
    "model": (
        "compile",
        "compile_scope",
        "compile_mode",
        "learning_rate",
        "weight_decay",
        "betas",
        "warmup_steps",
        "cosine_decay_steps",
        "min_lr_ratio",
        "float32_matmul_precision",
        "vocab_size",
        "dropout",
        "bias",
        "optimizer",
        "muon_learning_rate",
        "lr_schedule",
        "decay_fraction",
        "embedding_learning_rate",
        "head_learning_rate",
        "rotary",
        "norm",
        "norm_affine",
        "qk_norm",
        "activation",
        "tie_embeddings",
        "zero_init_proj",
        "logit_softcap",
        "value_embeddings",
        "window_pattern",
        "short_window_fraction",
    ),
}


def ran_at(precision: str) -> str:
    """The precision a CPU run of a config asking for ``precision`` trains at, here."""
    return fast_precision("cpu")[0] if precision == "auto" else precision


def test_every_config_is_covered():
    assert set(CONFIGS) == set(CASES) | set(OVERLAYS)  # a new config needs a case here


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, shakespeare):
    """The folders the configs name, relative to the working directory: FineWeb shards as the recipe
    expects them, and a local GPT-2 (1 layer, 2 heads, 32 wide, 64 positions) for init_from."""
    transformers = pytest.importorskip("transformers")
    import torch

    root = tmp_path_factory.mktemp("as-written")
    (root / "texts").mkdir()
    (root / "texts" / "a.txt").write_text(shakespeare[:60_000])
    main(
        ["tokenize", "--input", str(root / "texts"), "--output", str(root / "edu_fineweb10B"), "--shard_tokens", "4000"]
    )
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "gpt2")
    return root


def written(name: str) -> dict:
    return yaml.safe_load((REPO / "configs" / name).read_text())


# config -> extra shrinking only (intervals, the tokens of one step scaled with batch x block)
CASES = {  # validation intervals stay as written (past these steps): validation is timed elsewhere
    "tiny-cpu.yaml": [],
    "gpt2-124m.yaml": [],
    "gpt2-124m-fast.yaml": [],
    "gpt2-medium.yaml": [],
    "gpt2-large.yaml": [],
    "gpt2-xl.yaml": [],
    # 524,288 tokens = 64 x 1024 x 8 micro-batches on one GPU: the same 8 at 2 x 32.
    "gpt2-124m-fineweb.yaml": ["--data.tokens_per_step", str(2 * 32 * 8)],
    "gpt2-124m-fineweb-muon.yaml": ["--data.tokens_per_step", str(2 * 32 * 8)],  # the same, with Muon and WSD
    "modern-tiny-cpu.yaml": ["--model.n_layer", "2"],  # its SSSL windows block 0 (the last block is always long)
    "modern-124m-fineweb.yaml": ["--data.tokens_per_step", str(2 * 32 * 8)],  # the same 8, modern switches on
    "finetune-gpt2-shakespeare.yaml": [],  # init_from gpt2: the folder ./gpt2 here
}
XFAIL: dict = {}  # a config that cannot train as written yet, with the reason


def params():
    for name in [*CASES, *OVERLAYS]:
        yield pytest.param(name, marks=XFAIL.get(name, ()), id=name)


@pytest.mark.parametrize("name", params())
def test_the_config_trains_as_written(name, workdir, monkeypatch, in_process_group):
    monkeypatch.chdir(workdir)  # logs/, edu_fineweb10B and gpt2 (init_from's hub name: a local folder here)
    configs = [OVERLAYS[name], name] if name in OVERLAYS else [name]
    extra = CASES.get(name, ["--trainer.devices", "1"])  # the overlay: one CPU process
    args = [arg for config in configs for arg in ("--config", str(REPO / "configs" / config))]
    main(["fit", *args, *SHRINK, *extra])

    merged = {}
    for config in configs:
        for section, settings in written(config).items():
            merged.setdefault(section, {}).update(settings)
    logger = merged["trainer"]["logger"]["init_args"]
    run_dir = max((workdir / logger["save_dir"] / logger["name"]).glob("version_*"), key=lambda p: int(p.name[8:]))
    ran = yaml.safe_load((run_dir / "config.yaml").read_text())
    for section, keys in AS_WRITTEN.items():
        for key in keys:
            if key in merged.get(section, {}):
                value = ran[section][key]
                if (
                    isinstance(value, dict) and "init_args" not in merged[section][key]
                ):  # a class, its defaults filled in
                    value = {k: v for k, v in value.items() if k != "init_args"}
                assert value == merged[section][key], (section, key)
    if "tokens_per_step" in merged.get("data", {}):  # the recipe's accumulation: 8 micro-batches a step
        assert json.loads((run_dir / "throughput.json").read_text())["accumulate_grad_batches"] == 8
    facts = json.loads((run_dir / "throughput.json").read_text())
    # The GPU configs' bf16-mixed, or the CPU configs' auto: bf16-mixed where bf16 is native, else 32-true.
    assert merged["trainer"]["precision"] == ("auto" if merged["trainer"]["accelerator"] == "cpu" else "bf16-mixed")
    assert facts["precision"] == ran_at(merged["trainer"]["precision"])
    assert facts["compiled"] is ran["model"]["compile"] is True
    events = EventAccumulator(str(run_dir))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert len(losses) == STEPS and all(0 < loss < 12 for loss in losses)
    assert (run_dir / "checkpoints" / "last.ckpt").exists()
    if merged["model"].get("window_pattern", "L") != "L":  # a window a block really had, not only a recorded string
        config = gpt_from_checkpoint(run_dir / "checkpoints" / "last.ckpt").config
        assert any(config.attention_window(layer) is not None for layer in range(config.n_layer))


# --- every flag the README shows, at the precision of the config it is shown with -------------------
# The README's own command lines (checked to be there), shrunk as above; device counts of GPU
# commands become one CPU process; the CPU commands keep their 2 processes (subprocesses, the
# costly part of this module, ~35 s each). Eager: compilation as written is the configs' test above.
README_FLAGS = [
    "gpt-lightning fit --config configs/gpt2-xl.yaml --config configs/fsdp2.yaml --trainer.devices 8 "
    "--model.activation_checkpointing true",
    "gpt-lightning fit --config configs/tiny-cpu.yaml --config configs/fsdp2.yaml --trainer.accelerator cpu "
    "--trainer.devices 2",
    "gpt-lightning fit --config configs/tiny-cpu.yaml --trainer.strategy ddp --trainer.devices 2 --trainer.accelerator cpu",
]


@pytest.mark.parametrize("command", README_FLAGS, ids=["fsdp2-activation-checkpointing", "fsdp2-2-cpu", "ddp-2-cpu"])
def test_the_readme_s_flags_run_at_their_config_s_precision(command, workdir, tmp_path, in_process_group):
    import shlex

    from test_cli import run_cli
    from test_readme import COMMANDS

    words = shlex.split(command)
    assert words in COMMANDS, "the README and docs/ no longer show this command"
    args = [str(REPO / w) if w.startswith("configs/") else w for w in words[2:]]
    args = [*args, *SHRINK, "--model.compile", "false", "--trainer.logger.init_args.save_dir", str(tmp_path / "logs")]
    if "--trainer.accelerator" not in words:  # a GPU command: one CPU process
        args = [*args, "--trainer.devices", "1"]
        main(["fit", *args])
    else:
        result = run_cli("fit", *args, cwd=workdir)
        assert result.returncode == 0, result.stderr[-3000:]
    (run_dir,) = (tmp_path / "logs").glob("*/version_0")
    ran = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert ran["trainer"]["precision"] == ("auto" if "tiny-cpu" in command else "bf16-mixed")
    assert json.loads((run_dir / "throughput.json").read_text())["precision"] == ran_at(ran["trainer"]["precision"])
    events = EventAccumulator(str(run_dir))
    events.Reload()
    losses = [e.value for e in events.Scalars("train/loss")]
    assert len(losses) == STEPS and all(0 < loss < 12 for loss in losses)
