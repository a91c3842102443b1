"""The GPT-2 BPE encoding, built offline: OpenAI's two files ship in ``gpt2_bpe/`` (MIT-style
licence), checked against the sha256 hashes tiktoken's ``gpt2`` loader expects."""

from __future__ import annotations

import functools
import hashlib
from importlib import resources
from pathlib import Path

import tiktoken
from tiktoken.load import data_gym_to_mergeable_bpe_ranks

# The hashes tiktoken_ext.openai_public.gpt2() checks its downloads against.
VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
# GPT-2's pre-tokenizer regex, as in tiktoken_ext.openai_public.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
END_OF_TEXT = "<|endoftext|>"
GPT2_VOCAB_SIZE = 50257
BPE_FOLDER = "gpt2_bpe"  # package data of gpt_lightning.data: OpenAI's two files and their licence


def _bpe_file(name: str, expected_sha256: str) -> str:
    path = Path(str(resources.files(__package__) / BPE_FOLDER / name))
    if not path.is_file():
        raise RuntimeError(f"GPT-2's {name} is missing from the installed package ({path}). Reinstall gpt-lightning.")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != expected_sha256:
        raise RuntimeError(
            f"{path} has sha256 {digest}, not the GPT-2 file's {expected_sha256}: the installed package is "
            "damaged. Reinstall gpt-lightning."
        )
    return str(path)


def bpe_files() -> tuple[str, str]:
    """Paths of GPT-2's ``vocab.bpe`` and ``encoder.json``, checked: Hugging Face calls the same
    two files ``merges.txt`` and ``vocab.json``."""
    return _bpe_file("vocab.bpe", VOCAB_BPE_SHA256), _bpe_file("encoder.json", ENCODER_JSON_SHA256)


@functools.lru_cache(maxsize=1)
def gpt2_encoding() -> tiktoken.Encoding:
    """The GPT-2 tiktoken ``Encoding`` (50257 tokens, ``<|endoftext|>`` = 50256), built offline."""
    vocab_bpe, encoder_json = bpe_files()
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=vocab_bpe,
        encoder_json_file=encoder_json,
        vocab_bpe_hash=VOCAB_BPE_SHA256,
        encoder_json_hash=ENCODER_JSON_SHA256,
    )
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={END_OF_TEXT: GPT2_VOCAB_SIZE - 1},
        explicit_n_vocab=GPT2_VOCAB_SIZE,
    )
