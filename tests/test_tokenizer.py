import socket
from pathlib import Path

import pytest

from gpt_lightning.data import tokenizer
from gpt_lightning.data.corpus import Corpus


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_gpt2_encoding_builds_offline_and_counts_tiny_shakespeare(no_network):
    tokenizer.gpt2_encoding.cache_clear()
    enc = tokenizer.gpt2_encoding()
    assert enc.n_vocab == 50257
    assert enc.eot_token == 50256
    text = Corpus.tiny_shakespeare().open_text().read()
    ids = enc.encode_ordinary(text)
    assert len(ids) == 338025  # the reference's "loaded 338025 tokens"
    assert enc.decode(ids) == text


def test_known_gpt2_ids():
    enc = tokenizer.gpt2_encoding()
    # Ids every GPT-2 implementation agrees on.
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.encode("<|endoftext|>", allowed_special="all") == [50256]


def test_the_bpe_files_are_the_package_s_own():
    vocab_bpe, encoder_json = map(Path, tokenizer.bpe_files())
    folder = Path(tokenizer.__file__).parent / "gpt2_bpe"
    assert (vocab_bpe, encoder_json) == (folder / "vocab.bpe", folder / "encoder.json")
    assert "OpenAI" in (folder / "LICENSE").read_text()  # the licence they are distributed under


def test_tampered_bpe_file_is_refused(monkeypatch):
    monkeypatch.setattr(tokenizer, "VOCAB_BPE_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="vocab.bpe has sha256 .* Reinstall gpt-lightning"):
        tokenizer._bpe_file("vocab.bpe", tokenizer.VOCAB_BPE_SHA256)
