"""``val/bpb``: a real Trainer's validation gives the bits per byte computed by hand from the model's
log-probabilities and the bytes the target tokens decode to; ``<|endoftext|>`` counts neither. So
does ``gpt-lightning eval --text_file`` on a text longer than the model's context."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_MODEL
from lightning.pytorch import Trainer

from gpt_lightning import GPTLightningModule, TokenStreamDataModule, gpt2_encoding
from gpt_lightning.cli import main
from gpt_lightning.training.bits_per_byte import bits_and_bytes, token_byte_lengths


def test_validation_and_eval_give_the_bits_per_byte_of_a_hand_computation(tmp_path, shakespeare, capsys):
    enc = gpt2_encoding()
    ids = enc.encode_ordinary(shakespeare[:2000])
    (tmp_path / "shards").mkdir()  # validation: two documents, each begun by <|endoftext|>
    np.save(tmp_path / "shards" / "s_train_000000.npy", np.array(ids[:300], dtype=np.uint16))
    np.save(
        tmp_path / "shards" / "s_val_000000.npy",
        np.array([enc.eot_token, *ids[300:380], enc.eot_token, *ids[380:450]], dtype=np.uint16),
    )
    data = TokenStreamDataModule(str(tmp_path / "shards"), batch_size=2, block_size=16)
    torch.manual_seed(0)
    module = GPTLightningModule(**TINY_MODEL, block_size=16, val_sample_tokens=0)
    trainer = Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    (logged,) = trainer.validate(module, data, verbose=False)

    bits, nbytes, eots = 0.0, 0, 0
    with torch.no_grad():
        for x, y in data.val_dataloader():
            logp = F.log_softmax(module.model(x)[0].double(), dim=-1)  # (B, T, V)
            for row, targets in zip(logp, y):
                for t, target in enumerate(targets.tolist()):
                    if target == enc.eot_token:
                        eots += 1
                        continue
                    bits -= row[t, target].item() / math.log(2)
                    nbytes += len(enc.decode_bytes([target]))
    assert eots >= 1  # the separator is in the validation data, and left out
    assert logged["val/bpb"] == pytest.approx(bits / nbytes, rel=1e-5)
    # bits per byte = loss per token (nats) / ln 2 x tokens / bytes: fewer bits per byte than per token
    assert 0 < logged["val/bpb"] < logged["val/loss"] / math.log(2)

    # gpt-lightning eval --text_file: the same model on a text 2.5 windows long, in the harness's own
    # rolling windows of block_size (16) predictions, the first after <|endoftext|>.
    from lm_eval.utils import get_rolling_token_windows

    trainer.save_checkpoint(tmp_path / "model.ckpt")
    text = shakespeare[5000:5150]
    (tmp_path / "text.txt").write_text(text, encoding="utf-8")
    ids = enc.encode_ordinary(text)
    assert 33 <= len(ids) <= 47 and len(ids) % 16
    bits = 0.0
    with torch.no_grad():
        for inputs, predicted in get_rolling_token_windows(ids, enc.eot_token, 16, 1):
            logp = F.log_softmax(module.model(torch.tensor([inputs]))[0][0].double(), dim=-1)  # (len(inputs), V)
            bits -= logp[-len(predicted) :].gather(1, torch.tensor(predicted)[:, None]).sum().item() / math.log(2)
    out = tmp_path / "bpb.json"
    main(
        [
            "eval",
            "--ckpt_path",
            str(tmp_path / "model.ckpt"),
            "--text_file",
            str(tmp_path / "text.txt"),
            "--device",
            "cpu",
            "--dtype",
            "float32",  # compared with float32's bits to 1e-5
            "--output_path",
            str(out),
        ]
    )
    assert f"{bits / len(text.encode()):.4f} bits per byte" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["bytes"] == len(text.encode()) and result["tokens"] == len(ids)
    assert result["bpb"] == pytest.approx(bits / len(text.encode()), rel=1e-5)


def test_special_and_padded_ids_decode_to_no_bytes():
    enc = gpt2_encoding()
    lengths = token_byte_lengths(50304)
    text = "héllo, wörld 😀\n"
    ids = enc.encode_ordinary(text)
    assert lengths[ids].sum().item() == len(text.encode("utf-8"))
    assert lengths[enc.eot_token] == 0 and lengths[50257:].sum() == 0
    logits = torch.zeros(1, 2, 50304)  # uniform: each scored token costs log2(50304) bits
    bits, nbytes = bits_and_bytes(logits, torch.tensor([[ids[0], enc.eot_token]]), lengths)
    assert bits.item() == pytest.approx(math.log2(50304)) and nbytes.item() == len(enc.decode_bytes(ids[:1]))
