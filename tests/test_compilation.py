"""What a compiled fit compiles, and when: the training graph once in the first step; the sanity
check, validation and its samples eager (zero graphs) unless compile_eval, which gives the same
losses; one line says so. One real compiled fit (tiny model, the quick start's bf16-mixed) is shared."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch._dynamo
from conftest import COMPILED_TINY, TINY_MODEL
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from gpt_lightning.data.datamodule import TokenStreamDataModule
from gpt_lightning.observing.samples import ValidationSamples
from gpt_lightning.training.compilation import evaluation_stance, inductor_cache_dir
from gpt_lightning.training.module import GPTLightningModule


def graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


class GraphsPerPhase(Callback):
    """Graphs Dynamo compiled in each phase of a fit: the sanity check, each validation (its
    samples included: they are drawn in on_validation_epoch_end) and each training batch."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, int]] = []

    def _start(self) -> None:
        self._before = graphs()

    def _end(self, name: str) -> None:
        self.phases.append((name, graphs() - self._before))

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._start()

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._end("sanity")

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._start()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._end("validation")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._start()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._end("step")


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def compiled_fit(tmp_path_factory, shakespeare):
    """A compiled (scope model) fit of 3 steps in bf16-mixed, validating (and sampling) after each,
    after a 2-batch sanity check; its phases' graph counts and its info lines."""
    tmp = tmp_path_factory.mktemp("compiled_fit")
    text = tmp / "small.txt"
    text.write_text(shakespeare[:50_000])
    torch._dynamo.reset()
    module = GPTLightningModule(**COMPILED_TINY, compile_scope="model", val_sample_tokens=4)
    data = TokenStreamDataModule(str(text), batch_size=2, block_size=32, val_fraction=0.1, cache_dir=str(tmp))
    phases = GraphsPerPhase()
    trainer = Trainer(
        accelerator="cpu",
        max_steps=3,
        precision="bf16-mixed",
        val_check_interval=1,
        check_val_every_n_epoch=None,
        limit_val_batches=2,
        num_sanity_val_steps=2,
        logger=TensorBoardLogger(tmp / "tb"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[phases, ValidationSamples()],
    )
    lines, lightning_log = Lines(), logging.getLogger("lightning.pytorch.utilities.rank_zero")
    lightning_log.addHandler(lines)
    level = lightning_log.level
    lightning_log.setLevel(logging.INFO)
    try:
        trainer.fit(module, data)
    finally:
        lightning_log.removeHandler(lines)
        lightning_log.setLevel(level)
    return trainer, module, data, phases.phases, lines.lines


def test_training_compiles_once_and_evaluation_never(compiled_fit):
    trainer, module, _, phases, _ = compiled_fit
    assert module.is_compiled
    names = [name for name, _ in phases]
    assert names[0] == "sanity" and names.count("step") == 3 and names.count("validation") == 3
    # The sanity check and every validation (with its sampled text) ran eager: no graph at all.
    assert [count for name, count in phases if name != "step"] == [0, 0, 0, 0]
    # The first step compiled the training graph (one, the whole model); the next ones reused it.
    assert [count for name, count in phases if name == "step"] == [1, 0, 0]
    assert "val/loss" in trainer.callback_metrics


def test_one_line_says_what_the_first_step_waits_for(compiled_fit):
    lines = compiled_fit[4]
    notices = [line for line in lines if line.startswith("torch.compile:")]
    assert len(notices) == 1, lines
    assert "first training step" in notices[0] and inductor_cache_dir() in notices[0]
    assert "--model.compile_eval true" in notices[0]


def test_compiled_evaluation_gives_the_eager_losses(compiled_fit):
    trainer, module, data, _, _ = compiled_fit
    (eager,) = trainer.validate(module, data, verbose=False)
    module.hparams.compile_eval = True
    try:
        before = graphs()
        (compiled,) = trainer.validate(module, data, verbose=False)
        assert graphs() > before  # compile_eval really compiled the evaluation graph
    finally:
        module.hparams.compile_eval = False
    # Same weights, same batches, bf16 autocast either way: equal to bf16's precision (3 significant digits).
    assert compiled["val/loss"] == pytest.approx(eager["val/loss"], rel=4e-3)


def test_the_sanity_check_is_eager_even_with_compile_eval():
    torch._dynamo.reset()
    double = torch.compile(lambda x: x * 2)
    before = graphs()
    for compile_eval in (False, True):
        with evaluation_stance(compile_eval, sanity_checking=True):
            assert torch.equal(double(torch.ones(3)), torch.full((3,), 2.0))
    with evaluation_stance(False, sanity_checking=False):
        double(torch.ones(3))
    assert graphs() == before  # nothing compiled: every call ran the function's own code


def test_the_cache_dir_named_is_inductors(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert inductor_cache_dir() == str(tmp_path / "inductor")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    assert inductor_cache_dir() == cache_dir()  # and the default is where inductor would write
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")  # cache_dir() exported it


def test_a_model_compiled_by_blocks_copies_and_pickles():
    """An EMA-style deepcopy of a module compiled by regions computes with the copy's weights, and
    torch.save of the module works (the compiled head was once a function tied to the original; the
    unpickled model runs the head eager)."""
    import copy
    import pickle

    from gpt_lightning.training.compilation import compile_in_place

    module = GPTLightningModule(**TINY_MODEL)
    compile_in_place(module.model, "blocks")
    twin = copy.deepcopy(module)
    assert twin.model.head_and_loss.__self__ is twin.model
    assert module.model.head_and_loss.__self__ is module.model
    restored = pickle.loads(pickle.dumps(module))
    assert restored.model.head_and_loss.__self__ is restored.model
    idx = torch.randint(0, 50257, (1, 8))
    with torch.compiler.set_stance("force_eager"):  # the same numbers, without compiling here
        torch.testing.assert_close(restored.model(idx)[0], module.model(idx)[0])


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_modes_are_refused_under_accumulation_on_cuda(monkeypatch, mode):
    """On CUDA these modes record CUDA graphs, whose replays overwrite the first micro-batch's
    gradient (pytorch#169545): the module refuses them in one line naming what works. The CUDA
    device is stood in for (no GPU here): what is tested is the module's own decision."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from gpt_lightning.errors import UserError

    module = GPTLightningModule(**{**TINY_MODEL, "compile": True, "compile_mode": mode})
    module.trainer = Trainer(accelerator="cpu", accumulate_grad_batches=8, logger=False, enable_progress_bar=False)
    monkeypatch.setattr(SingleDeviceStrategy, "root_device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(UserError, match="records CUDA graphs.*null \\(default\\) or 'max-autotune-no-cudagraphs'"):
        module.setup("fit")
    module.trainer.accumulate_grad_batches = 1  # one micro-batch a step: allowed
    module.setup("fit")
    module.hparams.compile_mode = "max-autotune-no-cudagraphs"
    module.trainer.accumulate_grad_batches = 8
    module.setup("fit")


def test_reduce_overhead_on_a_cpu_trains_as_eager_under_accumulation(tmp_path, shakespeare):
    """On a CPU, reduce-overhead records no CUDA graph: under 2 accumulated micro-batches a step it
    trains as eager does (float32, so the losses agree to rounding)."""
    text = tmp_path / "small.txt"
    text.write_text(shakespeare[:20_000])
    losses = {}
    for compile in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        module = GPTLightningModule(**{**TINY_MODEL, "compile": compile, "compile_mode": "reduce-overhead"})
        data = TokenStreamDataModule(
            str(text), batch_size=2, block_size=32, cache_dir=str(tmp_path), tokens_per_step=128
        )
        trainer = Trainer(
            accelerator="cpu",
            max_steps=3,
            log_every_n_steps=1,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, data)
        assert trainer.accumulate_grad_batches == 2
        losses[compile] = float(trainer.callback_metrics["train/loss"])
    assert losses[True] == pytest.approx(losses[False], abs=1e-4)
