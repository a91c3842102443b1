"""HellaSwag scoring: the arithmetic checked by hand on a tiny model, answers a hand-built model must
get right, the offline error, and `gpt-lightning eval` on a file the test writes."""

import json
import urllib.request

import pytest
import torch
import torch.nn.functional as F

from gpt_lightning import hellaswag
from gpt_lightning.cli import main
from gpt_lightning.data import gpt2_encoding
from gpt_lightning.errors import UserError
from gpt_lightning.model import GPT, GPTConfig

ENCODE = gpt2_encoding().encode_ordinary
EXAMPLE = hellaswag.Example("A man is sitting on a roof. He", ("starts pulling up roofing.", "is ripping level tiles off.",
                            "is holding a rubik's cube.", "starts pulling up the roof."), 3)


def test_scoring_matches_a_hand_computation():
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, vocab_size=50257, n_layer=1, n_head=2, n_embd=16)).eval()
    tokens, mask = hellaswag.render(EXAMPLE, ENCODE)
    mean, summed = hellaswag.ending_losses(model, tokens, mask)
    context = ENCODE(EXAMPLE.context)
    for i, ending in enumerate(EXAMPLE.endings):
        ids = context + ENCODE(" " + ending)
        with torch.no_grad():
            logits, _ = model(torch.tensor([ids]))
        # Token j of the ending is predicted at position len(context) + j - 1.
        per_token = [F.cross_entropy(logits[0, len(context) + j - 1], torch.tensor(ids[len(context) + j])).item()
                     for j in range(len(ids) - len(context))]
        assert summed[i].item() == pytest.approx(sum(per_token), abs=1e-4)
        assert mean[i].item() == pytest.approx(sum(per_token) / len(per_token), abs=1e-5)


def model_that_always_says(token: int) -> GPT:
    """Blocks that add nothing and a final LayerNorm with zero gain: every position's logits are
    wte @ ln_f.bias, which the hand-set rows make huge for `token` alone."""
    model = GPT(GPTConfig(block_size=128, vocab_size=50257, n_layer=1, n_head=1, n_embd=8)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.wte.weight[token, 0] = 1.0
        model.transformer.ln_f.bias[0] = 20.0
    return model


def write_examples(path, examples):
    path.write_text("".join(json.dumps({"ctx": e.context, "endings": list(e.endings), "label": e.label}) + "\n"
                            for e in examples))
    return path


def test_a_model_that_prefers_an_ending_chooses_it(tmp_path):
    (the,) = ENCODE(" the")
    examples = []
    for label in (0, 3, 1, 2):
        endings = ["quickly ran home.", "ate an apple.", "sang a song."]
        endings.insert(label, "the the the")  # the only ending made of the model's favourite token
        examples.append(hellaswag.Example("She looked at the sky and", tuple(endings), label))
    path = write_examples(tmp_path / "val.jsonl", examples)
    result = hellaswag.evaluate(model_that_always_says(the), hellaswag.read_examples(path), ENCODE, torch.device("cpu"))
    assert result == {"acc_norm": 1.0, "acc": 1.0, "examples": 4}


def test_offline_without_the_file_says_where_to_put_it(tmp_path, monkeypatch):
    def offline(*args, **kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(UserError, match=r"put it at .*hellaswag_val\.jsonl, or pass it with --data_file"):
        hellaswag.validation_file(tmp_path)
    assert not (tmp_path / "hellaswag").exists()


def test_the_eval_command_on_a_checkpoint(tmp_path, capsys):
    model = model_that_always_says(ENCODE(" the")[0])
    ckpt = tmp_path / "always-the.ckpt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "hyper_parameters": {"block_size": 128, "vocab_size": 50257, "n_layer": 1, "n_head": 1, "n_embd": 8}}, ckpt)
    path = write_examples(tmp_path / "val.jsonl", [EXAMPLE, hellaswag.Example("Then", ("a b", "the the", "c d", "e f"), 1)])
    main(["eval", "--task", "hellaswag", "--ckpt_path", str(ckpt), "--data_file", str(path), "--out", str(tmp_path / "r.json")])
    assert "hellaswag: acc_norm" in capsys.readouterr().out
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["examples"] == 2 and saved["acc_norm"] >= 0.5  # the second example it cannot miss


def test_a_malformed_line_is_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"ctx": "x", "endings": ["a", "b"], "label": 0}\n')
    with pytest.raises(UserError, match="bad.jsonl, line 1: expected 4 endings"):
        list(hellaswag.read_examples(path))
