"""Checkpoints move between compiled and eager code, export to plain weights, refuse other shapes."""

import dataclasses
import json
import os
import stat

import pytest
import torch
from conftest import ONE_QUIET_CPU_STEP, TINY_MODEL
from lightning.pytorch import Trainer

from gpt_lightning.commands.export import main as export_main
from gpt_lightning.data.datamodule import TokenStreamDataModule
from gpt_lightning.errors import UserError
from gpt_lightning.interop.weights import export_weights, load_gpt
from gpt_lightning.training.module import GPTLightningModule


def fit_tiny(tmp_path, small_text, **overrides):
    module = GPTLightningModule(**{**TINY_MODEL, **overrides})
    data = TokenStreamDataModule(
        str(small_text), batch_size=2, block_size=32, val_fraction=0.0, cache_dir=str(tmp_path)
    )
    trainer = Trainer(**{**ONE_QUIET_CPU_STEP, "max_steps": 2}, default_root_dir=tmp_path)
    trainer.fit(module, data)
    ckpt = tmp_path / "tiny.ckpt"
    trainer.save_checkpoint(ckpt)
    return module, ckpt


@pytest.fixture
def eager_ckpt(tmp_path, small_text):
    return fit_tiny(tmp_path, small_text)


def test_eager_checkpoint_loads_into_a_compiled_module(eager_ckpt):
    eager, ckpt = eager_ckpt
    compiled = GPTLightningModule.load_from_checkpoint(ckpt, compile=True)
    compiled.configure_model()
    assert compiled.is_compiled and not eager.is_compiled
    idx = torch.randint(0, 50257, (2, 32))
    eager.eval(), compiled.eval()
    torch.testing.assert_close(compiled(idx)[0], eager(idx)[0], rtol=1e-4, atol=1e-4)
    for key, value in eager.state_dict().items():
        assert torch.equal(compiled.state_dict()[key], value)


def test_exported_weights_work_without_lightning(eager_ckpt, tmp_path):
    eager, ckpt = eager_ckpt
    out = tmp_path / "export" / "gpt.safetensors"
    old_umask = os.umask(0o022)
    try:
        export_main(["--ckpt_path", str(ckpt), "--out", str(out)])
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644  # as any file the user writes (safetensors alone: 0600)
    model = load_gpt(out).eval()
    assert model.config == eager.config
    assert model.lm_head.weight is model.transformer.wte.weight  # tying restored
    idx = torch.randint(0, 50257, (1, 16))
    torch.testing.assert_close(model(idx)[0], eager.eval()(idx)[0])
    assert not list(out.parent.glob(".*.tmp*"))


def test_checkpoint_of_another_architecture_names_the_mismatch(eager_ckpt):
    _, ckpt = eager_ckpt
    with pytest.raises(UserError, match=r"n_embd: checkpoint 32, this model 64"):
        GPTLightningModule.load_from_checkpoint(ckpt, n_embd=64)
    with pytest.raises(UserError, match=r"n_layer: checkpoint 2, this model 3"):
        GPTLightningModule.load_from_checkpoint(ckpt, n_layer=3)


def with_settings(ckpt, model):
    """A copy of ``ckpt`` whose saved settings also hold ``model``."""
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
    checkpoint["hyper_parameters"].update(model)
    path = ckpt.with_name(f"{ckpt.stem}-{len(list(ckpt.parent.glob('*.ckpt')))}.ckpt")
    torch.save(checkpoint, path)
    return path


def test_a_file_with_settings_this_version_does_not_have_is_refused_naming_them(eager_ckpt, small_text, tmp_path):
    eager, ckpt = eager_ckpt
    export_weights(ckpt, tmp_path / "w.safetensors")
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "newer.safetensors"
    config = {**dataclasses.asdict(eager.config), "smear": False}
    save_file(load_file(tmp_path / "w.safetensors"), weights, metadata={"gpt_config": json.dumps(config)})
    with pytest.raises(UserError, match=f"Weights file {weights} records settings .* does not have: smear. Load it"):
        load_gpt(weights)
    newer = with_settings(ckpt, {"smear": False, "backout": True})
    with pytest.raises(UserError, match="The checkpoint records settings .* does not have: backout, smear. Load"):
        GPTLightningModule.load_from_checkpoint(newer)
    data = TokenStreamDataModule(str(small_text), batch_size=2, block_size=32, val_fraction=0.0)
    trainer = Trainer(**{**ONE_QUIET_CPU_STEP, "max_steps": 3}, default_root_dir=tmp_path)
    with pytest.raises(UserError, match=f"Checkpoint {newer} records settings .* does not have: backout, smear"):
        trainer.fit(GPTLightningModule(**TINY_MODEL), data, ckpt_path=newer)


def test_export_of_a_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        export_weights(tmp_path / "nope.ckpt", tmp_path / "out.safetensors")


def test_sample_command_continues_a_prompt_from_a_checkpoint(eager_ckpt, capsys):
    from gpt_lightning.cli import main
    from gpt_lightning.data.tokenizer import gpt2_encoding

    _, ckpt = eager_ckpt
    args = ["sample", "--ckpt_path", str(ckpt), "--prompt", "ROMEO:", "--max_new_tokens", "12", "--num_samples", "2"]
    main(args)
    first = capsys.readouterr().out
    main(args)
    assert capsys.readouterr().out == first  # seeded: reproducible
    samples = first.split("--- sample ")[1:]
    assert len(samples) == 2
    for sample in samples:
        text = sample.split("\n", 1)[1].rstrip("\n")
        assert text.startswith("ROMEO:")
        assert len(gpt2_encoding().encode(text, allowed_special="all")) >= 8  # prompt + new tokens


def test_sample_in_bfloat16_reads_bf16_weights_and_cache(eager_ckpt, monkeypatch):
    from gpt_lightning.commands import sample as command
    from gpt_lightning.commands.sample import sample
    from gpt_lightning.model import KVCache

    _, ckpt = eager_ckpt
    seen = []
    store = KVCache.store
    monkeypatch.setattr(KVCache, "store", lambda self, k, v, pos: (seen.append(k.dtype), store(self, k, v, pos))[1])
    generate = command.generate
    monkeypatch.setattr(
        command,
        "generate",
        lambda model, *a, **kw: (seen.append(model.lm_head.weight.dtype), generate(model, *a, **kw))[1],
    )
    texts = sample(ckpt, prompt="ROMEO:", max_new_tokens=6, temperature=0, dtype="bfloat16", device="cpu")
    assert texts[0].startswith("ROMEO:") and len(texts[0]) > len("ROMEO:")
    assert seen[0] == torch.bfloat16
    assert set(seen[1:]) == {torch.bfloat16}  # every layer's cached keys
    with pytest.raises(UserError, match=r"--dtype 'float8' is not one of auto, float32, bfloat16, float16"):
        sample(ckpt, dtype="float8")


def test_sample_defaults_to_bfloat16_where_the_device_runs_it_natively(monkeypatch, capsys):
    """``--dtype auto`` (the default): bfloat16 on a bf16 GPU and on a CPU whose bf16 matmul is measured
    native, float32 on a CPU that emulates it or an older GPU, said on stderr. (The GPU and both kinds
    of CPU are stood in for.)"""
    import inspect

    from gpt_lightning.commands.sample import resolve_dtype, sample
    from gpt_lightning.training import precision

    assert inspect.signature(sample).parameters["dtype"].default == "auto"
    monkeypatch.setattr(precision, "cpu_bf16_slowdown", lambda: 0.6)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.bfloat16
    assert "--dtype auto: bfloat16 (this CPU runs bf16 natively" in capsys.readouterr().err
    monkeypatch.setattr(precision, "cpu_bf16_slowdown", lambda: 30.0)
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert "--dtype auto: float32 (this CPU emulates bf16" in capsys.readouterr().err
    # On a GPU it is initialized first (sample and eval run on it next) and asked in place, not in a child.
    monkeypatch.setattr(torch.cuda, "init", lambda: monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(precision, "cuda_has_bf16", precision.cuda_has_bf16.__wrapped__)  # uncached
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.float32
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16


def test_top_k_0_samples_among_the_whole_vocabulary(eager_ckpt, monkeypatch):
    from gpt_lightning.commands import sample as command
    from gpt_lightning.commands.sample import sample

    _, ckpt = eager_ckpt
    seen = []
    generate = command.generate
    monkeypatch.setattr(
        command, "generate", lambda model, *a, **kw: (seen.append(kw["top_k"]), generate(model, *a, **kw))[1]
    )
    sample(ckpt, prompt="ROMEO:", max_new_tokens=3, top_k=0, device="cpu")
    sample(ckpt, prompt="ROMEO:", max_new_tokens=3, top_k=5, device="cpu")
    assert seen == [None, 5]


def test_sample_from_a_checkpoint_with_a_smaller_vocabulary_says_why_it_cannot(tmp_path):
    """A model trained on the user's own token ids (vocab_size 1000) cannot take GPT-2 text: one line, not
    the embedding's IndexError."""
    from gpt_lightning.commands.sample import sample

    module = GPTLightningModule(**{**TINY_MODEL, "vocab_size": 1000})
    ckpt = tmp_path / "small-vocab.ckpt"
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, ckpt)
    with pytest.raises(UserError, match=r"has a vocabulary of 1000 tokens, fewer than the GPT-2 encoding's 50257"):
        sample(ckpt, prompt="ROMEO:", max_new_tokens=2, device="cpu")
