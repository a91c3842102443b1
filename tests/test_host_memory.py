"""``keep_freed_memory``: a freed large block is reused without the kernel faulting its pages in
again, and a CPU fit asks for it (a plain ``Trainer``, as a notebook runs it)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ONE_QUIET_CPU_STEP, TINY_MODEL
from lightning.pytorch import Trainer

import gpt_lightning.training.module
from gpt_lightning import GPTLightningModule, TokenStreamDataModule

# In a fresh process (the setting is the process's): page faults over 30 rounds of a 64 MB tensor
# written and freed, with glibc's defaults or after keep_freed_memory.
FAULTS = """
import resource, sys, torch
from gpt_lightning.host_memory import keep_freed_memory

applied = keep_freed_memory() if sys.argv[1] == "keep" else None
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    torch.ones(16 * 2**20)  # 64 MB of float32: over glibc's 32 MB mmap threshold
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, applied)
"""


def faults(setting: str, **env: str) -> tuple[int, str]:
    cmd = [sys.executable, "-c", FAULTS, setting]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env={**os.environ, **env}).stdout
    count, applied = out.split()
    return int(count), applied


def huge_pages_always() -> bool:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[always]" in path.read_text()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
@pytest.mark.skipif(huge_pages_always(), reason="a 64 MB block faults in 2 MB pages: too few faults to compare")
def test_a_freed_block_comes_back_without_page_faults():
    (plain, _), (kept, applied) = faults("plain"), faults("keep")
    assert applied == "True"
    # glibc's default maps each round's 16,384 pages of 4 KB afresh; kept, the heap grows for a few
    # rounds (small blocks freed into glibc's per-thread cache sit after the big one: measured up to
    # 9 rounds) and then every round reuses it: under half the faults.
    assert plain > 30 * 1000, plain
    assert kept < plain / 2, (plain, kept)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_malloc_settings_in_the_environment_are_left_as_the_user_set_them():
    assert faults("keep", MALLOC_MMAP_THRESHOLD_="33554432")[1] == "False"


def test_a_cpu_fit_keeps_freed_memory(monkeypatch, small_text, tmp_path):
    calls = []
    monkeypatch.setattr(gpt_lightning.training.module, "keep_freed_memory", lambda: calls.append(True))
    model = GPTLightningModule(**TINY_MODEL)
    data = TokenStreamDataModule(str(small_text), batch_size=2, block_size=16, cache_dir=str(tmp_path))
    trainer = Trainer(**ONE_QUIET_CPU_STEP)
    trainer.fit(model, data)
    assert calls == [True]
    trainer.validate(model, data)  # only fit changes the process's malloc
    assert calls == [True]
