"""Tiny Shakespeare: read from the cache, downloaded with a sha256 check, clear errors offline."""

import io
import urllib.request

import pytest

from conftest import SHARED_SHAKESPEARE
from gpt_lightning.data import corpus
from gpt_lightning.errors import UserError


def serve(monkeypatch, payload):
    def fake_urlopen(url, timeout):
        if isinstance(payload, Exception):
            raise payload
        return io.BytesIO(payload)

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)


def test_offline_without_a_cache_says_what_to_do(tmp_path, monkeypatch):
    serve(monkeypatch, OSError("network is unreachable"))
    with pytest.raises(UserError) as info:
        corpus.tiny_shakespeare(tmp_path)
    message = str(info.value)
    assert "Could not download tiny Shakespeare" in message
    assert str(tmp_path / corpus.TINY_SHAKESPEARE_FILENAME) in message and "--data.data_path" in message


def test_a_download_with_the_wrong_hash_is_not_cached(tmp_path, monkeypatch):
    serve(monkeypatch, b"not shakespeare")
    with pytest.raises(UserError, match="sha256"):
        corpus.tiny_shakespeare(tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not SHARED_SHAKESPEARE.is_file(), reason="needs ../shared's copy as the served payload")
def test_a_good_download_is_cached_and_then_read_without_network(tmp_path, monkeypatch):
    serve(monkeypatch, SHARED_SHAKESPEARE.read_bytes())
    path = corpus.tiny_shakespeare(tmp_path)
    assert corpus.sha256_file(path) == corpus.TINY_SHAKESPEARE_SHA256
    serve(monkeypatch, OSError("offline now"))
    assert corpus.tiny_shakespeare(tmp_path) == path  # served from the cache


def test_a_corrupted_cached_copy_is_fetched_again(tmp_path, monkeypatch):
    (tmp_path / corpus.TINY_SHAKESPEARE_FILENAME).write_text("truncated")
    serve(monkeypatch, OSError("offline"))
    with pytest.raises(UserError, match="Could not download"):
        corpus.tiny_shakespeare(tmp_path)


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(corpus.CACHE_ENV, str(tmp_path / "c"))
    assert corpus.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv(corpus.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert corpus.default_cache_dir() == tmp_path / "xdg" / "gpt_lightning"
