"""A weight EMA through Lightning's own ``EMAWeightAveraging``, as users add it: validation, the
validation samples and the periodic evaluations read the averaged weights (whatever the callbacks'
order), the checkpoint's ``state_dict`` is the average (what export, sample and eval load), the trained
weights are resumed from it, compiled runs keep plain keys, the memory guide counts the copy, FSDP2 is
refused. Exact resume: tests/test_resume_exact.py's "ema" case."""

import logging
from types import SimpleNamespace

import pytest
import torch
from conftest import COMPILED_TINY, REPO, TINY_FIT, TINY_MODEL, tiny_flags
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy

import gpt_lightning.observing.samples as samples_module
from gpt_lightning import GPTLightningModule, TokenStreamDataModule
from gpt_lightning.averaging import check_weight_averaging
from gpt_lightning.cli import main
from gpt_lightning.commands.eval import load_model
from gpt_lightning.errors import UserError
from gpt_lightning.evaluation.periodic import PeriodicEvaluation
from gpt_lightning.interop.checkpoint import gpt_from_checkpoint
from gpt_lightning.interop.weights import export_weights, load_gpt
from gpt_lightning.lightning_internals import averaged_model, rank_zero_logger
from gpt_lightning.model import GPTConfig
from gpt_lightning.observing.samples import ValidationSamples
from gpt_lightning.scaling.memory import parameter_count, training_memory

WEIGHT = "transformer.wte.weight"  # the tied embedding and head: any update moves it


class AverageRecorder(Callback):
    """The averaged weights after each optimizer step (step 0: the copy made at setup)."""

    def __init__(self, ema: EMAWeightAveraging) -> None:
        self.ema, self.by_step = ema, {}

    def _record(self, trainer):
        state = averaged_model(self.ema).module.model.state_dict()
        self.by_step[trainer.global_step] = {k: v.clone() for k, v in state.items()}

    def on_train_start(self, trainer, pl_module):
        self._record(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._record(trainer)


class WeightsSeen(PeriodicEvaluation):
    """A periodic evaluation that records the weights it would score."""

    def __init__(self) -> None:
        super().__init__(every_n_steps=1)
        self.seen = []

    def evaluate(self, trainer, pl_module):
        self.seen.append((trainer.global_step, pl_module.model.transformer.wte.weight.detach().clone()))


def tiny_run(small_text, root, callbacks, max_steps=3, **module_kwargs):
    module = GPTLightningModule(**dict(TINY_MODEL, n_layer=1), block_size=32, **module_kwargs)
    data = TokenStreamDataModule(str(small_text), batch_size=2, block_size=32, val_fraction=0.1)
    trainer = Trainer(
        accelerator="cpu",
        precision="32-true",
        max_steps=max_steps,
        val_check_interval=3,  # once, at the last step
        check_val_every_n_epoch=None,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        callbacks=[*callbacks, ModelCheckpoint(dirpath=root, save_last=True, save_top_k=0)],
    )
    return module, data, trainer


@pytest.mark.parametrize("averaging_first", [True, False], ids=["ema-listed-first", "ema-listed-last"])
def test_validation_samples_evaluations_and_the_checkpoint_read_the_averaged_weights(
    small_text, tmp_path, monkeypatch, caplog, averaging_first
):
    caplog.set_level(logging.INFO)
    # the CLI's filter of that line, left on Lightning's logger by any CLI run earlier in this process
    monkeypatch.setattr(rank_zero_logger(), "filters", [])
    ema = EMAWeightAveraging(decay=0.5)  # a short memory: the average is far from the trained weights
    recorder, evaluation = AverageRecorder(ema), WeightsSeen()
    sampled = []

    def spy(model, idx, *args, **kwargs):
        sampled.append(model.transformer.wte.weight.detach().clone())
        return idx

    monkeypatch.setattr(samples_module, "generate", spy)
    ours = [ValidationSamples(tokens=2), evaluation]
    callbacks = [ema, *ours] if averaging_first else [*ours, ema]
    module, data, trainer = tiny_run(small_text, tmp_path, [*callbacks, recorder])
    trainer.fit(module, data)
    assert caplog.text.count("`Trainer.fit` stopped") == 1  # Lightning's own line, not again from our read of it

    average = recorder.by_step[3]
    checkpoint = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)
    saved = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items()}
    trained = {k.removeprefix("model."): v for k, v in checkpoint["current_model_state"].items()}
    assert saved.keys() == average.keys() == trained.keys()
    assert all(torch.equal(saved[k], average[k]) for k in average)  # state_dict: the callback's average
    assert not torch.equal(trained[WEIGHT], average[WEIGHT])
    assert checkpoint["averaging_state"]["n_averaged"] == 3

    # export, load_gpt, sample and eval (gpt_from_checkpoint, load_model) read the averaged weights
    export_weights(tmp_path / "last.ckpt", tmp_path / "w.safetensors")
    for model in (load_gpt(tmp_path / "w.safetensors"), gpt_from_checkpoint(tmp_path / "last.ckpt")):
        assert all(torch.equal(model.state_dict()[k], average[k]) for k in average)
    assert torch.equal(load_model(str(tmp_path / "last.ckpt"), None).transformer.wte.weight, average[WEIGHT])

    # the validation loss logged is that of the averaged weights on the validation batch
    x, y = next(iter(data.val_dataloader()))
    model = gpt_from_checkpoint(tmp_path / "last.ckpt").eval()
    with torch.no_grad():
        averaged_loss = model(x, y)[1]
        model.load_state_dict(trained)
        trained_loss = model(x, y)[1]
    assert trainer.callback_metrics["val/loss"].item() == pytest.approx(averaged_loss.item(), abs=1e-6)
    assert abs(averaged_loss.item() - trained_loss.item()) > 1e-4  # the two are told apart

    (sample,) = sampled  # one validation, at step 3
    assert torch.equal(sample, average[WEIGHT])
    steps = [step for step, _ in evaluation.seen]
    assert steps == [0, 1, 2, 3]  # as each step starts, and at the end
    for step, weight in evaluation.seen:
        assert torch.equal(weight, recorder.by_step[step][WEIGHT]), step
    # after fit the module holds the average (the stock callback's on_train_end), its own copy the same
    assert torch.equal(module.model.transformer.wte.weight, average[WEIGHT])


def test_a_fit_resumed_without_the_callback_trains_on_from_the_trained_weights(small_text, tmp_path):
    ema = EMAWeightAveraging(decay=0.5)
    module, data, trainer = tiny_run(small_text, tmp_path, [ema], max_steps=2)
    trainer.fit(module, data)
    checkpoint = torch.load(tmp_path / "last.ckpt", map_location="cpu", weights_only=True)

    class Loaded(Callback):
        def on_train_start(self, trainer, pl_module):
            self.weight = pl_module.model.transformer.wte.weight.detach().clone()

    loaded = Loaded()
    module, data, trainer = tiny_run(small_text, tmp_path / "again", [loaded], max_steps=3)
    trainer.fit(module, data, ckpt_path=tmp_path / "last.ckpt")
    assert torch.equal(loaded.weight, checkpoint["current_model_state"]["model." + WEIGHT])
    assert not torch.equal(loaded.weight, checkpoint["state_dict"]["model." + WEIGHT])


def test_the_cli_trains_a_compiled_model_with_the_benchmarks_ema_flags(small_text, tmp_path, capfd, caplog):
    """``--trainer.callbacks+=EMAWeightAveraging --trainer.callbacks.decay 0.95`` (benchmarks/muon_variants.py's
    EMA) on the suite's compiled shape: plain keys in both weight sets, the copy in the memory line."""
    import sys

    caplog.set_level(logging.INFO)
    sys.path.insert(0, str(REPO / "benchmarks"))
    from test_benchmarks import load_benchmark

    ema_flags = load_benchmark("muon_variants").EMA
    main(
        [
            *TINY_FIT,
            *tiny_flags(
                {
                    **{f"model.{k}": v for k, v in COMPILED_TINY.items()},
                    "model.val_sample_tokens": 2,
                    "data.data_path": small_text,
                    "data.block_size": 32,
                    "trainer.max_steps": 2,
                    "trainer.val_check_interval": 2,
                    "trainer.limit_val_batches": 1,
                    "trainer.enable_progress_bar": False,
                    "trainer.logger.init_args.save_dir": tmp_path,
                }
            ),
            *ema_flags,
        ]
    )
    (ckpt,) = tmp_path.glob("*/version_0/checkpoints/last.ckpt")
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert checkpoint["state_dict"].keys() == checkpoint["current_model_state"].keys()
    assert not [k for k in checkpoint["state_dict"] if "_orig_mod" in k]
    assert checkpoint["callbacks"]["EMAWeightAveraging"] == {"latest_update_step": 2}
    err = "".join(capfd.readouterr())
    assert "the averaged weights (EMAWeightAveraging)" in caplog.text  # the memory line counts the copy
    assert "overrides the configure_model" not in err  # Lightning's sharding warning: not ours to act on


def test_fsdp2_and_two_averaging_callbacks_are_refused():
    fsdp2 = SimpleNamespace(callbacks=[EMAWeightAveraging()], strategy=ModelParallelStrategy())
    with pytest.raises(UserError, match=r"EMAWeightAveraging does not run under FSDP2.*--trainer.strategy ddp"):
        check_weight_averaging(fsdp2)
    two = SimpleNamespace(callbacks=[EMAWeightAveraging(), EMAWeightAveraging()], strategy=None)
    with pytest.raises(UserError, match="Keep one"):
        check_weight_averaging(two)


def test_the_memory_guide_counts_the_averaged_copy():
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32)
    plain, averaged = training_memory(config, 2, 32), training_memory(config, 2, 32, weight_average=True)
    assert averaged.weight_average == averaged.total - plain.total == 4 * parameter_count(config)
