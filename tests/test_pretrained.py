"""GPT-2 in Hugging Face format, in and out, without the network: a small random GPT2LMHeadModel
saved with save_pretrained stands in for OpenAI's weights."""

import json
import shutil

import pytest
import torch
import yaml
from conftest import TINY_FIT, tiny_flags

from gpt_lightning.cli import main
from gpt_lightning.errors import UserError
from gpt_lightning.training.module import GPTLightningModule

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory):
    """A 2-layer, 32-wide GPT-2 with a 64-token position table, saved as Hugging Face saves it."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config).eval()
    directory = tmp_path_factory.mktemp("hf") / "tiny-gpt2"
    model.save_pretrained(directory)
    return directory, model


def logits_agree(ours, theirs, T=16):
    idx = torch.randint(0, 50257, (2, T))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], theirs(idx).logits, rtol=0, atol=1e-5)


def test_init_from_a_hugging_face_directory_gives_its_logits(hf_gpt2):
    directory, theirs = hf_gpt2
    module = GPTLightningModule(init_from=str(directory), compile=False).eval()
    assert (module.config.n_layer, module.config.n_embd, module.config.block_size) == (2, 32, 64)
    assert module.hparams.init_from is None and module.hparams.pretrained_from == str(directory)
    assert module.hparams_initial["n_layer"] == 2  # what the logger records, too
    logits_agree(module, theirs)


def test_a_pytorch_bin_without_the_transformer_prefix_loads_too(hf_gpt2, tmp_path):
    _, theirs = hf_gpt2
    state = {k.removeprefix("transformer."): v for k, v in theirs.state_dict().items() if k != "lm_head.weight"}
    torch.save(state, tmp_path / "pytorch_model.bin")
    theirs.config.to_json_file(tmp_path / "config.json")
    logits_agree(GPTLightningModule(init_from=str(tmp_path / "pytorch_model.bin"), compile=False).eval(), theirs)


def test_block_size_can_be_cropped_never_lengthened(hf_gpt2):
    directory, theirs = hf_gpt2
    cropped = GPTLightningModule(init_from=str(directory), block_size=32, compile=False).eval()
    assert cropped.model.transformer.wpe.weight.shape[0] == 32
    logits_agree(cropped, theirs, T=32)
    with pytest.raises(UserError, match=r"block_size 128 is longer than .* position table \(64\)"):
        GPTLightningModule(init_from=str(directory), block_size=128, compile=False)


def test_a_contradicting_option_and_a_missing_tensor_are_named(hf_gpt2, tmp_path):
    directory, _ = hf_gpt2
    with pytest.raises(UserError, match="model.n_layer 3 contradicts .*'s 2"):
        GPTLightningModule(init_from=str(directory), n_layer=3, compile=False)
    from safetensors.torch import load_file, save_file

    shutil.copy(directory / "config.json", tmp_path / "config.json")
    state = load_file(str(directory / "model.safetensors"))
    del state["transformer.h.1.mlp.c_fc.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(UserError, match=r"missing transformer\.h\.1\.mlp\.c_fc\.weight"):
        GPTLightningModule(init_from=str(tmp_path), compile=False)


def test_a_hub_name_offline_says_what_to_do(monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(
        UserError,
        match=r"Could not fetch 'gpt2' .* give init_from \(fit's --model.init_from, eval's --init_from\) a local copy",
    ):
        GPTLightningModule(init_from="gpt2", compile=False)


def test_fine_tune_through_the_cli_then_export_to_hugging_face(hf_gpt2, tmp_path):
    directory, theirs = hf_gpt2
    source = tmp_path / "source"
    shutil.copytree(directory, source)
    # tiny-cpu.yaml sets its own architecture; the one given here agrees with the checkpoint's.
    main(
        [
            *TINY_FIT,
            *tiny_flags(
                {
                    "model.init_from": source,
                    "model.n_layer": 2,
                    "data.block_size": 32,
                    "trainer.max_steps": 2,
                    "trainer.logger.init_args.save_dir": tmp_path / "tb",
                }
            ),
        ]
    )
    run_dir = tmp_path / "tb" / "tiny-cpu" / "version_0"
    saved = yaml.safe_load((run_dir / "hparams.yaml").read_text())
    # Fine-tuned on 32-token rows, the model keeps the source's 64 positions (its context).
    assert (saved["n_layer"], saved["n_embd"], saved["block_size"], saved["init_from"]) == (2, 32, 64, None)
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    shutil.rmtree(source)  # the fine-tuned checkpoint stands on its own
    # Resuming with the same command line does not read init_from (the source is gone now).
    main(
        [
            *TINY_FIT,
            *tiny_flags(
                {
                    "model.init_from": source,
                    "model.n_layer": 2,
                    "data.block_size": 32,
                    "trainer.max_steps": 3,
                    "trainer.logger.init_args.save_dir": tmp_path / "tb",
                }
            ),
            "--ckpt_path",
            str(ckpt),
        ]
    )

    out = tmp_path / "hf-out"
    main(["export", "--format", "hf", "--ckpt_path", str(ckpt), "--out", str(out)])
    exported = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    tuned = GPTLightningModule.load_from_checkpoint(ckpt, compile=False).eval()
    logits_agree(tuned, exported, T=32)
    with torch.no_grad():  # and training really moved the weights away from the start
        assert not torch.allclose(tuned.model.transformer.wte.weight, theirs.transformer.wte.weight)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.encode("Hello world") == [15496, 995]
    assert json.loads((out / "config.json").read_text())["n_positions"] == 64
    logits_agree(tuned, exported, T=64)  # the whole context, past the 32 tokens it was tuned on


def test_the_position_table_is_cropped_only_when_model_block_size_is_given(hf_gpt2, tmp_path):
    directory, _ = hf_gpt2
    main(
        [
            *TINY_FIT,
            *tiny_flags(
                {
                    "model.init_from": directory,
                    "model.n_layer": 2,
                    "model.block_size": 48,
                    "data.block_size": 32,
                    "trainer.max_steps": 1,
                    "trainer.logger.init_args.save_dir": tmp_path / "tb",
                }
            ),
        ]
    )
    ckpt = tmp_path / "tb" / "tiny-cpu" / "version_0" / "checkpoints" / "last.ckpt"
    main(["export", "--format", "hf", "--ckpt_path", str(ckpt), "--out", str(tmp_path / "hf-out")])
    assert json.loads((tmp_path / "hf-out" / "config.json").read_text())["n_positions"] == 48
