"""The release as a user installs it: the wheel and the sdist built from the sources, each installed into a
fresh venv without the network, run `gpt-lightning --help` and the quick start's `fit`."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from conftest import COMPILED_TINY, REPO

from gpt_lightning.data.corpus import CACHE_ENV

PACKAGED = ("gpt_lightning/data/tinyshakespeare.txt.gz", "gpt_lightning/data/gpt2_bpe/vocab.bpe")


def run(args: list, cwd: Path, timeout: int = 300, **env: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **env}  # only what the venv holds
    env["PIP_NO_INDEX"] = "1"  # offline: nothing may come from a registry
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (args, result.stdout[-2000:], result.stderr[-3000:])
    return result


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The wheel and the sdist, built from a copy of the sources (building writes beside them)."""
    root = tmp_path_factory.mktemp("release")
    source = root / "source"
    shutil.copytree(REPO / "gpt_lightning", source / "gpt_lightning", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    build = "from setuptools import build_meta as b; b.build_wheel({0!r}); b.build_sdist({0!r})"
    run([sys.executable, "-c", build.format(str(root / "dist"))], cwd=source)
    return root / "dist"


def fresh_venv(path: Path) -> Path:
    """A new venv whose own site-packages is empty; the test environment's packages (torch, Lightning, the
    build backend) reach it through a path file, so the package itself comes only from what pip installs."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    (site,) = path.glob("lib/python*/site-packages")
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return path / "bin"


def test_the_version_is_tag_ready():
    assert '\nversion = "0.1.0"\n' in (REPO / "pyproject.toml").read_text()
    assert "## [0.1.0]" in (REPO / "CHANGELOG.md").read_text()


def test_the_wheel_and_the_sdist_carry_the_corpus_the_bpe_files_and_the_licences(dist):
    (wheel,) = dist.glob("gpt_lightning-0.1.0-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        headers = archive.read(metadata).decode().split("\n\n")[0].splitlines()
    assert set(PACKAGED) <= names
    assert "License-Expression: MIT" in headers  # PEP 639: the SPDX expression and both licence files
    assert {"License-File: LICENSE", "License-File: gpt_lightning/data/gpt2_bpe/LICENSE"} <= set(headers)
    (sdist,) = dist.glob("gpt_lightning-0.1.0.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert set(PACKAGED) | {"pyproject.toml", "LICENSE", "README.md"} <= names


def install(artifact: Path, venv: Path) -> Path:
    """``artifact`` pip-installed offline into a fresh ``venv``: its bin folder."""
    bin_dir = fresh_venv(venv)
    flags = ["--no-deps", "--ignore-installed", "--no-build-isolation"]
    run([bin_dir / "python", "-m", "pip", "install", "-q", *flags, artifact], cwd=venv)
    where = run([bin_dir / "python", "-c", "import gpt_lightning; print(gpt_lightning.__file__)"], cwd=venv)
    assert where.stdout.startswith(str(venv)), where.stdout
    assert "fit" in run([bin_dir / "gpt-lightning", "--help"], cwd=venv).stdout
    return bin_dir


def test_the_sdist_installs_and_runs_help_offline(dist, tmp_path):
    install(next(dist.glob("gpt_lightning-0.1.0.tar.gz")), tmp_path / "venv")


def test_the_installed_wheel_runs_the_quick_start_offline(dist, tmp_path):
    bin_dir = install(next(dist.glob("gpt_lightning-0.1.0-*.whl")), tmp_path / "venv")
    # The quick start's config as written, in the suite's compiled tiny shape and two steps; from a folder
    # without the repository, so the corpus and the tokenizer come from the installed package.
    shutil.copy(REPO / "configs" / "tiny-cpu.yaml", tmp_path / "tiny-cpu.yaml")
    sizes = [f"--model.{key}={value}" for key, value in COMPILED_TINY.items() if key != "compile"]
    args = ["fit", "--config", "tiny-cpu.yaml", *sizes, "--data.batch_size=2", "--data.block_size=32"]
    args += ["--trainer.max_steps=2", "--trainer.limit_val_batches=1"]
    result = run([bin_dir / "gpt-lightning", *args], cwd=tmp_path, **{CACHE_ENV: str(tmp_path / "cache")})
    assert "loaded 338025 tokens" in result.stdout + result.stderr  # tiny Shakespeare, read from the wheel
    assert list((tmp_path / "logs" / "tiny-cpu").rglob("last.ckpt"))
