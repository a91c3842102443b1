"""Each bad input exits non-zero with one clear message, no traceback, and no half-written file."""

import json
import multiprocessing
import os
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._inductor.config
from conftest import TINY_MODEL
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins import MixedPrecision
from test_cli_errors import fit_args, run_main

from gpt_lightning.data import token_cache
from gpt_lightning.data.corpus import Corpus
from gpt_lightning.data.datamodule import TokenStreamDataModule
from gpt_lightning.errors import UserError
from gpt_lightning.training.compilation import check_kernels_can_build
from gpt_lightning.training.module import GPTLightningModule


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda t: ["--data.data_path", str(t / "missing.txt")], "does not exist"),
        (lambda t: ["--data.data_path", str(write(t / "empty.txt", b"  \n"))], "is empty"),
        (lambda t: ["--data.data_path", str(write(t / "bin.txt", b"ok \xff\xfe\x00 text"))], "is not UTF-8 text"),
        (
            lambda t: ["--data.data_path", str(write(t / "short.txt", b"Too short to train on."))],
            "needs world_size x batch_size x block_size + 1",
        ),
        (lambda t: ["--data.batch_size", "0"], "data.batch_size must be a positive integer"),
        (lambda t: ["--data.batch_size", "-4"], "data.batch_size must be a positive integer"),
        (
            lambda t: ["--data.block_size", "0"],
            "block_size must be a positive integer, got 0. (the CLI sets it from data.block_size)",
        ),
        (lambda t: ["--trainer.max_steps", "-5"], "max_steps"),
        (lambda t: ["--model.learning_rate", "0"], "model.learning_rate must be > 0"),
        (lambda t: ["--model.learning_rate", "-0.1"], "model.learning_rate must be > 0"),
    ],
    ids=[
        "missing",
        "empty",
        "not-utf8",
        "too-small",
        "batch-0",
        "batch-negative",
        "block-0",
        "steps-negative",
        "lr-0",
        "lr-negative",
    ],
)
def test_bad_input_is_one_clear_error(make_args, message, tmp_path, capsys):
    code, err = run_main(fit_args(tmp_path, *make_args(tmp_path)), capsys)
    assert code == 2
    assert message in err
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if "error:" in line]) == 1
    tokens = tmp_path / "cache" / "tokens"
    assert not tokens.exists() or not [p for p in tokens.iterdir() if ".tmp" in p.name]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cuda_without_a_gpu(tmp_path, capsys):
    code, err = run_main(fit_args(tmp_path, "--trainer.accelerator", "cuda"), capsys)
    assert code == 2 and "CUDAAccelerator` can not run on your system" in err and "Traceback" not in err


def test_data_block_size_larger_than_the_model_s(small_text, tmp_path):
    module = GPTLightningModule(**TINY_MODEL, block_size=16)
    data = TokenStreamDataModule(str(small_text), batch_size=2, block_size=32, cache_dir=str(tmp_path))
    trainer = Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    )
    with pytest.raises(UserError, match=r"data.block_size \(32\) is larger than the model's block_size \(16\)"):
        trainer.fit(module, data)


def test_too_few_tokens_for_every_rank(small_text, tmp_path):
    small_text.write_text(small_text.read_text()[:400])  # about 100 tokens: one rank's batch, not two
    data = TokenStreamDataModule(
        str(small_text), batch_size=1, block_size=64, val_fraction=0.0, cache_dir=str(tmp_path)
    )
    data.setup("fit")  # one process: fine
    data = TokenStreamDataModule(
        str(small_text), batch_size=1, block_size=64, val_fraction=0.0, cache_dir=str(tmp_path)
    )
    data.trainer = type("T", (), {"world_size": 2, "global_rank": 0, "accumulate_grad_batches": 1})()
    with pytest.raises(UserError, match="on each of 2 process"):
        data.setup("fit")


@pytest.mark.parametrize("damage", ["truncate", "flip-bytes", "other-tokenizer", "garbage-manifest"])
def test_damaged_token_cache_is_detected_and_rebuilt(damage, small_text, tmp_path, caplog):
    bin_path = token_cache.build_token_cache(Corpus.from_file(small_text), tmp_path)
    json_path = bin_path.with_suffix(".json")
    good = bin_path.read_bytes()
    if damage == "truncate":
        bin_path.write_bytes(good[: len(good) // 2])
    elif damage == "flip-bytes":
        bin_path.write_bytes(good[:10] + bytes(10) + good[20:])
    elif damage == "other-tokenizer":
        manifest = json.loads(json_path.read_text())
        json_path.write_text(json.dumps({**manifest, "tokenizer": "cl100k_base"}))
    else:
        json_path.write_text("{not json")
    with caplog.at_level("WARNING"):
        assert token_cache.build_token_cache(Corpus.from_file(small_text), tmp_path) == bin_path
    assert "Rebuilding token cache" in caplog.text
    assert bin_path.read_bytes() == good


def _prepare(args):
    source, cache = args
    return str(token_cache.build_token_cache(Corpus.from_file(source), Path(cache)))


def test_concurrent_preparation_does_not_corrupt_the_cache(small_text, tmp_path):
    big = tmp_path / "big.txt"
    big.write_text(small_text.read_text() * 20)  # slow enough for the two writers to overlap
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        paths = pool.map(_prepare, [(str(big), str(tmp_path / "cache"))] * 2)
    assert paths[0] == paths[1]
    tokens = np.fromfile(paths[0], dtype=np.uint16)
    assert len(tokens) == json.loads(Path(paths[0]).with_suffix(".json").read_text())["n_tokens"]
    assert not [p for p in (tmp_path / "cache" / "tokens").iterdir() if ".tmp" in p.name]
    assert (
        token_cache._problem(Path(paths[0]), Path(paths[0]).with_suffix(".json"), token_cache.sha256_file(big)) is None
    )


class NaNAtStep(GPTLightningModule):
    def __init__(self, nan_step: int, **kwargs):
        super().__init__(**kwargs)
        self.nan_step = nan_step

    def _loss(self, batch):
        loss = super()._loss(batch)
        return loss * float("nan") if self.global_step == self.nan_step else loss


def test_nan_loss_stops_training_and_keeps_the_last_good_checkpoint(small_text, tmp_path):
    module = NaNAtStep(nan_step=3, **TINY_MODEL)
    data = TokenStreamDataModule(
        str(small_text), batch_size=2, block_size=32, val_fraction=0.0, cache_dir=str(tmp_path)
    )
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True)
    trainer = Trainer(accelerator="cpu", max_steps=10, logger=False, callbacks=[checkpoint], enable_progress_bar=False)
    with pytest.raises(
        UserError, match=r"became non-finite \(nan or inf\) at step 3\. That update and every one after it were skipped"
    ):
        trainer.fit(module, data)
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 3
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())
    assert all(torch.isfinite(p).all() for p in module.parameters())  # the bad update never happened


def test_with_a_checkpoint_on_exception_a_nan_still_keeps_the_last_good_one(small_text, tmp_path):
    """With Lightning's checkpoint on exception turned on, the guard refuses the save after a
    non-finite step: the error is still the one line, and last.ckpt is the last good step's."""
    module = NaNAtStep(nan_step=3, **TINY_MODEL)
    data = TokenStreamDataModule(
        str(small_text), batch_size=2, block_size=32, val_fraction=0.0, cache_dir=str(tmp_path)
    )
    checkpoint = ModelCheckpoint(
        dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_last=True, save_on_exception=True
    )
    trainer = Trainer(
        accelerator="cpu",
        max_steps=10,
        logger=False,
        callbacks=[checkpoint],
        enable_progress_bar=False,
        precision="bf16-mixed",
        log_every_n_steps=1,
        enable_model_summary=False,
    )
    with pytest.raises(UserError, match=r"became non-finite \(nan or inf\) at step 3\."):
        trainer.fit(module, data)
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", map_location="cpu", weights_only=False)
    assert last["global_step"] == 3
    assert all(torch.isfinite(v).all() for v in last["state_dict"].values())


@pytest.mark.parametrize(
    "precision, optimizer",
    [("32-true", "adamw"), ("16-mixed", "adamw"), ("32-true", "muon")],
    ids=["32-true", "16-mixed", "muon"],
)
def test_a_nan_is_reported_at_the_next_logging_interval_and_no_update_follows_it(
    precision, optimizer, small_text, tmp_path
):
    """Under 16-mixed the GradScaler skips the updates (their gradients are made non-finite on the
    device) and the host reads nothing until the interval, as with fused AdamW's found_inf. On CPU
    the 16-mixed flag becomes bf16-mixed: the plugin keeps fp16 and its GradScaler."""

    def fit(module, max_steps):
        seed_everything(0)
        # a fresh GradScaler for each run: its scale shapes the fp16 gradients
        amp = {"precision": "32-true"} if precision == "32-true" else {"plugins": [MixedPrecision("16-mixed", "cpu")]}
        data = TokenStreamDataModule(
            str(small_text), batch_size=2, block_size=32, val_fraction=0.0, cache_dir=str(tmp_path)
        )
        trainer = Trainer(
            accelerator="cpu",
            **amp,
            max_steps=max_steps,
            log_every_n_steps=5,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, data)
        return trainer

    seed_everything(0)
    bad = NaNAtStep(nan_step=3, **TINY_MODEL, optimizer=optimizer)
    with pytest.raises(UserError, match="non-finite .* at step 3") as info:
        fit(bad, max_steps=10)
    assert bad.trainer.global_step == 5  # found at the logging interval: no host read before it
    seed_everything(0)
    good = GPTLightningModule(**TINY_MODEL, optimizer=optimizer)
    fit(good, max_steps=3)
    # Steps 3 and 4 updated nothing: the weights are those after 3 good steps.
    for (name, ours), theirs in zip(bad.state_dict().items(), good.state_dict().values()):
        assert torch.equal(ours, theirs), name
    assert "Traceback" not in str(info.value)
    # The advice fits the run: only a float16 one is told to use bf16-mixed.
    assert ("use bf16-mixed instead of float16" in str(info.value)) == (precision == "16-mixed")


def without_python_headers(monkeypatch, tmp_path, prefix_headers: Path | None = None) -> None:
    """sysconfig as on a Python without headers: every include folder empty (the posix_prefix scheme's
    holding ``prefix_headers`` if given, as a Debian Python's with python3-dev whose default scheme points elsewhere)."""
    get_path, get_config_var = sysconfig.get_path, sysconfig.get_config_var

    def path(name, *args, **kwargs):
        if name != "include":
            return get_path(name, *args, **kwargs)
        return str(prefix_headers if prefix_headers and kwargs.get("scheme") == "posix_prefix" else tmp_path)

    monkeypatch.setattr(sysconfig, "get_path", path)
    monkeypatch.setattr(
        sysconfig, "get_config_var", lambda name: str(tmp_path) if name == "INCLUDEPY" else get_config_var(name)
    )


@pytest.mark.parametrize("missing", ["python headers", "c++ compiler"])
def test_compiling_where_kernels_cannot_build_says_what_to_install(missing, monkeypatch, tmp_path, capsys):
    """A machine without Python's headers (no python3-dev) or without a C++ compiler: the quick start's
    compiled fit and `sample --compile` stop before compiling (and before reading the checkpoint), saying
    what to install or how to run eager, rather than failing in the first step on a C++ error about Python.h."""
    if missing == "python headers":
        if sys.platform == "darwin":
            pytest.skip("macOS: inductor also finds the headers in Python's framework")
        without_python_headers(monkeypatch, tmp_path)
        message = "apt install python3-dev"
    else:
        message = "apt install g++"
    with torch._inductor.config.patch({"cpp.cxx": ("no-such-c++",)} if missing == "c++ compiler" else {}):
        code, err = run_main(fit_args(tmp_path, "--model.compile", "true"), capsys)
        assert code != 0 and message in err and "--model.compile false" in err and "Traceback" not in err, err[-2000:]
        code, err = run_main(["sample", "--ckpt_path", str(tmp_path / "none.ckpt"), "--compile"], capsys)
        assert code != 0 and message in err and "without --compile" in err, err[-2000:]


@pytest.mark.skipif(sys.platform == "darwin" or os.name != "posix", reason="the posix_prefix scheme: Linux")
def test_the_kernel_check_asks_only_for_what_inductor_needs(monkeypatch, tmp_path):
    """No C++ compiler refuses only a CPU's compile (a GPU's kernels are Triton's; None: the device is not
    known yet, as for a model loaded outside a Trainer); Python.h in the posix_prefix scheme's folder alone,
    which inductor also passes to the compiler, is enough."""
    with torch._inductor.config.patch({"cpp.cxx": ("no-such-c++",)}):
        check_kernels_can_build("cuda")
        check_kernels_can_build(None)
        with pytest.raises(UserError, match="found none"):
            check_kernels_can_build("cpu")
    prefix = tmp_path / "prefix"
    prefix.mkdir()
    without_python_headers(monkeypatch, tmp_path, prefix)
    with pytest.raises(UserError, match="no Python.h"):
        check_kernels_can_build("cuda")
    (prefix / "Python.h").touch()
    check_kernels_can_build("cpu")
