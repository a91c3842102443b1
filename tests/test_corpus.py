"""Tiny Shakespeare (and GPT-2's BPE files) ship inside the package: read offline and verified (the wheel: test_release)."""

import gzip
import hashlib
import json
import os
import stat
import subprocess
import sys

import pytest
from conftest import REPO

from gpt_lightning.data import corpus, token_cache
from gpt_lightning.data.corpus import Corpus
from gpt_lightning.errors import UserError


def test_the_packaged_corpus_is_tiny_shakespeare(shakespeare):
    raw = shakespeare.encode("utf-8")
    assert len(raw) == 1_115_394
    assert hashlib.sha256(raw).hexdigest() == corpus.TINY_SHAKESPEARE_SHA256
    assert shakespeare.startswith("First Citizen:\nBefore we proceed any further, hear me speak.")


def test_a_damaged_packaged_copy_is_refused(tmp_path):
    fake = tmp_path / corpus.TINY_SHAKESPEARE_RESOURCE
    fake.write_bytes(gzip.compress(b"First Citizen:\nnot the real text\n"))
    with pytest.raises(UserError, match="is damaged .* Reinstall gpt-lightning"):
        corpus._read_packaged(fake)


# Runs `fit` on the default corpus in a fresh process whose sockets refuse to connect.
OFFLINE_FIT = """
import socket
def refuse(*args, **kwargs):
    raise OSError("network disabled by the test")
socket.socket.connect = refuse
socket.create_connection = refuse
from gpt_lightning.cli import main
main(["fit", "--config", "configs/tiny-cpu.yaml", "--model.compile", "false", "--trainer.max_steps", "2",
      "--trainer.limit_val_batches", "0", "--model.n_layer", "1", "--model.n_embd", "32", "--model.n_head", "2",
      "--trainer.logger.init_args.save_dir", {save_dir!r}])
"""


def test_the_default_corpus_trains_without_network(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), corpus.CACHE_ENV: str(tmp_path / "empty-cache")}
    result = subprocess.run(
        [sys.executable, "-c", OFFLINE_FIT.format(save_dir=str(tmp_path / "tb"))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded 338025 tokens" in result.stdout + result.stderr
    assert list((tmp_path / "tb").rglob("last.ckpt"))


def test_cached_files_get_normal_permissions_and_an_absolute_source(small_text, tmp_path, monkeypatch):
    monkeypatch.chdir(small_text.parent)
    old = os.umask(0o022)
    try:
        bin_path = token_cache.build_token_cache(Corpus.from_file(small_text.name), tmp_path / "cache")
    finally:
        os.umask(old)
    manifest_path = bin_path.with_suffix(".json")
    for path in (bin_path, manifest_path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path
    assert json.loads(manifest_path.read_text())["source"] == str(small_text.resolve())


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(corpus.CACHE_ENV, str(tmp_path / "c"))
    assert corpus.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv(corpus.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert corpus.default_cache_dir() == tmp_path / "xdg" / "gpt_lightning"
