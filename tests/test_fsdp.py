"""FSDP2 through Lightning's ModelParallelStrategy, on CPU processes with gloo, through the CLI.

Lightning documents ModelParallelStrategy for GPUs, but its FSDP2 path runs on a CPU mesh too, so
everything but NCCL and speed is tested here: the plan shards every Block, compiled regions and
activation checkpointing compose with it, sharded checkpoints resume and load, and 1, 2 and 4
processes (HSDP) train what DDP trains, 2 micro-batches a step, each rank's collectives counted. Those
2- and 4-process runs train the modern model (every switch on, value embeddings included, with AdamW
and the untied embedding's and head's own rates: Muon is refused under FSDP2); GPT-2 runs on 2 FSDP2
processes in the NaN test here and in the README's fsdp2-2-cpu command (test_configs_as_written).
FSDP2 over gloo has had a gradient-averaging bug upstream
(gradients summed, not averaged, over ranks); AdamW hides a constant gradient scale from the loss
for a few steps, so every comparison here also checks the logged gradient norm, which would double.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist
from conftest import MODERN_FLAGS, REPO, TINY_FIT, TINY_MODEL, tiny_flags
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.strategies import ModelParallelStrategy
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_bad_input import NaNAtStep
from test_cli import run_cli
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from gpt_lightning import GPTLightningModule, TokenStreamDataModule, UserError
from gpt_lightning.cli import main
from gpt_lightning.interop.checkpoint import gpt_from_checkpoint
from gpt_lightning.model import GPT, GPTConfig
from gpt_lightning.scaling.sharding import shard_gpt, sharding_mesh
from gpt_lightning.training.optimizers import is_embedding, is_head

# tiny-cpu.yaml's throughput warm-up kept (5 steps, past these runs' 4): its reduces stay out of the counted collectives.
TINY = tiny_flags(
    {
        "model.n_layer": 2,
        "trainer.precision": "32-true",
        "data.val_fraction": 0,
        "trainer.log_every_n_steps": 1,
        "trainer.accelerator": "cpu",
        "throughput.warmup_steps": None,
    }
)
FSDP = ["--config", str(REPO / "configs/fsdp2.yaml")]  # what the README gives users
# Validation with a sample every 2 steps: generating runs forward passes that, sharded, all ranks join.
VALIDATE = [
    "--data.val_fraction",
    "0.1",
    "--trainer.limit_val_batches",
    "1",
    "--trainer.val_check_interval",
    "2",
    "--model.val_sample_tokens",
    "4",
]


# The modern model of configs/modern-tiny-cpu.yaml, with AdamW: its rates for the untied embedding and head.
RATES = {"embedding": 0.1, "head": 0.004, "rest": 1e-3}  # the last: model.learning_rate's default
MODERN = [
    *MODERN_FLAGS,
    "--model.embedding_learning_rate",
    str(RATES["embedding"]),
    "--model.head_learning_rate",
    str(RATES["head"]),
]
# Two micro-batches per optimizer step: what every GPU recipe does, and where FSDP2 reduces.
ACCUMULATE = ["--trainer.accumulate_grad_batches", "2"]
ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}  # the probes' callbacks


def counting(workdir, name, **init_args):
    """The callback argument that has each rank count its collectives per step (``grad_probes``)."""
    probe = {
        "class_path": "grad_probes.CollectiveCounter",
        "init_args": {"out_dir": str(workdir / "collectives" / name), **init_args},
    }
    return f"--trainer.callbacks+={json.dumps(probe)}"


def collectives(workdir, name, ranks):
    return [json.loads((workdir / "collectives" / name / f"rank{r}.json").read_text())["steps"] for r in range(ranks)]


def fit(workdir, text, name, *extra, check=True):
    result = run_cli(
        *TINY_FIT,
        *TINY,
        "--data.data_path",
        str(text),
        "--trainer.logger.init_args.save_dir",
        str(workdir / "tb"),
        "--trainer.logger.init_args.name",
        name,
        *extra,
        cwd=workdir,
        env_extra=ENV,
    )
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def fit_here(workdir, text, name, *extra):
    """``fit`` as ``fit`` above, in this process: for one rank, a subprocess proves nothing more
    (the launches of ``gpt-lightning`` itself are the 2- and 4-process tests')."""
    main(
        [
            *TINY_FIT,
            *TINY,
            "--data.data_path",
            str(text),
            "--trainer.logger.init_args.save_dir",
            str(workdir / "tb"),
            "--trainer.logger.init_args.name",
            name,
            *extra,
        ]
    )


def logged(workdir, name, tag, version=None):
    runs = sorted((workdir / "tb" / name).glob("version_*"))
    events = EventAccumulator(str(runs[-1] if version is None else runs[version]))
    events.Reload()
    return [event.value for event in events.Scalars(tag)]


def last_checkpoint(workdir, name):
    return sorted((workdir / "tb" / name).glob("version_*/checkpoints/last.ckpt"))[-1]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, shakespeare):
    """The reference: 2 DDP processes, eager, 2 rows each, 2 micro-batches a step, 4 steps, the modern model."""
    workdir = tmp_path_factory.mktemp("fsdp")
    (workdir / "small.txt").write_text(shakespeare[:50_000])
    fit(
        workdir,
        workdir / "small.txt",
        "ddp",
        "--trainer.strategy",
        "ddp",
        "--trainer.devices",
        "2",
        "--data.batch_size",
        "2",
        "--trainer.max_steps",
        "4",
        *MODERN,
        *ACCUMULATE,
        *VALIDATE,
        counting(workdir, "ddp"),
    )
    return workdir


def assert_trains_like_ddp(workdir, name):
    assert logged(workdir, name, "train/loss") == pytest.approx(logged(workdir, "ddp", "train/loss"), rel=1e-5)
    # A sum over ranks instead of a mean would double the norm (the gloo averaging bug).
    assert logged(workdir, name, "train/grad_norm") == pytest.approx(
        logged(workdir, "ddp", "train/grad_norm"), rel=1e-4
    )
    # DDP reduces once per step (no_sync); FSDP2 reduce-scatters every micro-batch: the same sums.
    weights, reference = (
        gpt_from_checkpoint(last_checkpoint(workdir, name)).state_dict(),
        gpt_from_checkpoint(last_checkpoint(workdir, "ddp")).state_dict(),
    )
    assert weights.keys() == reference.keys()
    for key in reference:
        # Within 5% of one AdamW step at the weight's own rate (a lost or doubled update is a whole step;
        # a sum for a mean is the grad-norm check's): AdamW's m / sqrt(v) turns the summation order's
        # last bits into part of a step for rows whose gradient is near zero: the embeddings (rate 0.1)
        # differ by ~1e-4 where the matrices (1e-3) differ by ~1e-6 on an AMD EPYC; on an AMX Xeon
        # c_attn's reached 2.3% of a step.
        rate = RATES["embedding" if is_embedding(key) else "head" if is_head(key) else "rest"]
        torch.testing.assert_close(weights[key], reference[key], rtol=0, atol=0.05 * rate, msg=key)


def assert_no_flag_all_reduce(workdir, name, ranks):
    """The non-finite guard takes the norm of gradients already summed over ranks: a NaN on any
    rank is in every rank's norm, so it needs no collective of its own (it had one every step)."""
    for steps in collectives(workdir, name, ranks):
        assert len(steps) == 4 and [step["flag_all_reduce"] for step in steps] == [0] * 4


def test_ddp_needs_no_flag_all_reduce(ddp_run):
    assert_no_flag_all_reduce(ddp_run, "ddp", 2)


MODERN_SWITCHES = dict(
    bias=False,
    rotary=True,
    norm="rmsnorm",
    norm_affine=False,
    qk_norm=True,
    activation="relu2",
    tie_embeddings=False,
    zero_init_proj=True,
    logit_softcap=15.0,
    value_embeddings=True,
    residual_scalars=True,
)


@pytest.mark.parametrize("switches", [{}, MODERN_SWITCHES], ids=["gpt2", "modern"])
def test_the_plan_shards_every_block_then_the_root_and_keeps_the_keys(switches, tmp_path, in_process_group):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    assert sharding_mesh(mesh).ndim == 1  # no tensor parallelism here: plain FSDP
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, **switches))
    reference = GPT(model.config)
    reference.load_state_dict(model.state_dict())
    keys = list(model.state_dict())
    shard_gpt(model, sharding_mesh(mesh))
    assert all(isinstance(block, FSDPModule) for block in model.transformer.h)
    assert isinstance(model, FSDPModule)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert list(model.state_dict()) == keys  # in place: no wrapper prefix in any key
    assert (model.lm_head.weight is model.transformer.wte.weight) == model.config.tie_embeddings  # still tied (or not)
    x = torch.randint(0, model.config.vocab_size, (2, 16))
    torch.testing.assert_close(model(x, x)[1], reference(x, x)[1])


def test_two_processes_compiled_and_checkpointed_train_like_ddp(ddp_run):
    workdir = ddp_run
    fit(
        workdir,
        workdir / "small.txt",
        "fsdp",
        *FSDP,
        "--trainer.devices",
        "2",
        "--data.batch_size",
        "2",
        "--trainer.max_steps",
        "4",
        "--model.compile",
        "true",
        "--model.compile_scope",
        "blocks",
        "--model.activation_checkpointing",
        "true",
        *MODERN,
        *ACCUMULATE,
        *VALIDATE,
        counting(workdir, "fsdp"),
    )
    assert_trains_like_ddp(workdir, "fsdp")
    assert logged(workdir, "fsdp", "val/loss") == pytest.approx(logged(workdir, "ddp", "val/loss"), rel=1e-5)
    assert_no_flag_all_reduce(workdir, "fsdp", 2)
    # One FSDP mesh dimension: each micro-batch's reduce-scatter (3 units: 2 blocks and the root) keeps
    # the gradients sharded, and there is no all-reduce (docs/fsdp2.md: "Gradient accumulation").
    for steps in collectives(workdir, "fsdp", 2):
        assert [(step["reduce_scatter"], step["replica_all_reduce"]) for step in steps] == [(2 * 3, 0)] * 4
    sharded = last_checkpoint(workdir, "fsdp")
    assert sharded.is_dir() and (sharded / "meta.pt").is_file()  # one shard file per rank
    assert len(list(sharded.glob("*.distcp"))) == 2
    config = gpt_from_checkpoint(sharded).config  # the modern model, its switches recorded in the shards' meta.pt
    assert (config.rotary, config.tie_embeddings, config.value_embeddings, config.logit_softcap) == (
        True,
        False,
        True,
        15.0,
    )
    # What users do with a checkpoint works on the folder as on a file.
    # (In this process: `sample` and `export` read the folder the same way wherever they run.)
    main(["sample", "--ckpt_path", str(sharded), "--max_new_tokens", "5", "--device", "cpu"])
    main(["export", "--ckpt_path", str(sharded), "--out", str(workdir / "w.safetensors")])
    assert (workdir / "w.safetensors").stat().st_size > 0


def test_four_processes_on_a_two_by_two_mesh_train_like_ddp(ddp_run):
    """data_parallel 2 x tensor_parallel 2, the strategy's defaults on 2 nodes x 2 GPUs: HSDP."""
    workdir = ddp_run
    fit(
        workdir,
        workdir / "small.txt",
        "hsdp",
        *FSDP,
        "--trainer.strategy.init_args.data_parallel_size",
        "2",
        "--trainer.strategy.init_args.tensor_parallel_size",
        "2",
        "--trainer.devices",
        "4",
        "--data.batch_size",
        "1",
        "--trainer.max_steps",
        "4",
        *MODERN,
        *ACCUMULATE,
        *VALIDATE,
        counting(workdir, "hsdp"),
    )
    assert_trains_like_ddp(workdir, "hsdp")  # same 4 rows a micro-batch as 2 ranks x 2 rows
    assert_no_flag_all_reduce(workdir, "hsdp", 4)
    # Across the replicas ("nodes") once per optimizer step, for each of the 3 units; within a
    # replica, a reduce-scatter every micro-batch. Was 2 all-reduces per unit and step.
    for steps in collectives(workdir, "hsdp", 4):
        assert [(step["reduce_scatter"], step["replica_all_reduce"]) for step in steps] == [(2 * 3, 3)] * 4


# What the run warns about, as it did in its own process: DCP overwriting last.ckpt's folder, and
# Lightning's note on the checkpoint callback given anew on resume.
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint", "ignore:Be aware that when using `ckpt_path`")
def test_one_rank_mesh_trains_like_unsharded_and_resumes_exactly(tmp_path, small_text, in_process_group, capsys):
    fit_here(tmp_path, small_text, "plain", "--data.batch_size", "4", "--trainer.max_steps", "6")
    fit_here(
        tmp_path,
        small_text,
        "mesh",
        *FSDP,
        "--trainer.devices",
        "1",
        "--data.batch_size",
        "4",
        "--trainer.max_steps",
        "4",
        "--checkpoint.every_n_train_steps",
        "2",
    )
    # The folder's meta.pt gives the run's model settings, as a .ckpt file would (tiny-cpu.yaml,
    # given again, sets its own batch size: the command line wins over the checkpoint).
    fit_here(
        tmp_path,
        small_text,
        "mesh",
        *FSDP,
        "--trainer.devices",
        "1",
        "--data.batch_size",
        "4",
        "--trainer.max_steps",
        "6",
        "--ckpt_path",
        str(last_checkpoint(tmp_path, "mesh")),
    )
    losses = logged(tmp_path, "mesh", "train/loss", 0) + logged(tmp_path, "mesh", "train/loss", 1)
    assert losses == pytest.approx(logged(tmp_path, "plain", "train/loss"), rel=1e-5)

    # A learning rate given on resume is the one used, though the strategy restores AdamW itself.
    fit_here(
        tmp_path,
        small_text,
        "mesh",
        *FSDP,
        "--trainer.devices",
        "1",
        "--data.batch_size",
        "4",
        "--trainer.max_steps",
        "7",
        "--model.learning_rate",
        "0.005",
        "--ckpt_path",
        str(last_checkpoint(tmp_path, "mesh")),
    )
    rates = logged(tmp_path, "mesh", "lr-AdamW/pg1", 2)
    assert rates and rates == pytest.approx([0.005] * len(rates))

    # Without the strategy that reads shards: one line that says what to add, not a traceback.
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                *TINY_FIT,
                *TINY,
                "--data.data_path",
                str(small_text),
                "--trainer.logger.init_args.save_dir",
                str(tmp_path / "tb"),
                "--trainer.max_steps",
                "8",
                "--ckpt_path",
                str(last_checkpoint(tmp_path, "mesh")),
            ]
        )
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert "is a folder of shards, written under FSDP2, and only ModelParallelStrategy resumes it" in err


@pytest.mark.parametrize("switches", [{}, MODERN_SWITCHES], ids=["gpt2", "modern"])
def test_activation_checkpointing_keeps_less_and_computes_the_same_gradients(switches):
    torch.manual_seed(0)
    # A small vocabulary, so that the blocks' activations, not the logits, dominate what is kept.
    model = GPT(GPTConfig(n_layer=4, n_head=2, n_embd=32, block_size=16, vocab_size=128, **switches))
    if switches:  # off the modern init's zeros, so that every weight has a gradient to compare
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
    x = torch.randint(0, model.config.vocab_size, (2, 16))

    def backward(checkpointing: bool):
        model.zero_grad()
        model.activation_checkpointing = checkpointing
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: kept.append(t.numel() * t.element_size()) or t, lambda t: t
        ):
            _, loss = model(x, x)
        loss.backward()
        return sum(kept), {name: p.grad.clone() for name, p in model.named_parameters()}

    kept_all, grads = backward(False)
    kept_inputs, grads_recomputed = backward(True)
    assert kept_inputs < kept_all / 4  # the blocks' insides are recomputed, not kept
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads_recomputed[name], grad, msg=name)


def test_a_nan_is_skipped_on_the_device_and_reported_as_without_sharding(small_text, tmp_path, in_process_group):
    """The fused AdamW of sharded (DTensor) parameters honours the device-side found_inf flag."""

    def fit(module, max_steps):
        seed_everything(0)
        data = TokenStreamDataModule(str(small_text), batch_size=2, block_size=32, val_fraction=0.0)
        trainer = Trainer(
            accelerator="cpu",
            devices=1,
            strategy=ModelParallelStrategy(),
            precision="32-true",
            max_steps=max_steps,
            log_every_n_steps=5,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, data)

    seed_everything(0)
    bad = NaNAtStep(nan_step=3, **TINY_MODEL)
    with pytest.raises(UserError, match="non-finite .* at step 3"):
        fit(bad, max_steps=10)
    assert bad.trainer.global_step == 5  # found at the logging interval
    seed_everything(0)
    good = GPTLightningModule(**TINY_MODEL)
    fit(good, max_steps=3)
    for (name, ours), theirs in zip(bad.state_dict().items(), good.state_dict().values()):
        assert torch.equal(ours.full_tensor(), theirs.full_tensor()), name  # steps 3 and 4 changed nothing


@pytest.mark.parametrize("strategy", [["--trainer.strategy", "ddp"], FSDP], ids=["ddp", "fsdp2"])
def test_a_nan_on_one_rank_alone_skips_the_update_on_every_rank(strategy, tmp_path, small_text):
    """Rank 1's loss turns NaN at step 1's first micro-batch, after the module saw it finite: the
    gradients alone carry it, summed across ranks (DDP's all-reduce after the accumulation; FSDP2's
    reduce-scatter puts it in one rank's shard, whose norm is all-reduced), so every rank's guard
    skips that update without the flag all-reduce it had."""
    result = fit(
        tmp_path,
        small_text,
        "nan",
        *strategy,
        "--trainer.devices",
        "2",
        "--data.batch_size",
        "2",
        "--trainer.max_steps",
        "3",
        *ACCUMULATE,
        counting(tmp_path, "nan", nan_step=1),
        check=False,
    )
    assert result.returncode != 0 and "became non-finite (nan or inf) at step 1" in result.stderr
    for steps in collectives(tmp_path, "nan", 2):
        assert len(steps) == 2 and [step["flag_all_reduce"] for step in steps] == [0, 0]
        assert steps[1]["weights"] == steps[0]["weights"]  # step 1 changed nothing on this rank
