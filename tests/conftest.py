"""Shared fixtures: a private token cache for the whole session, small texts, tiny configs; the
order the test files run in."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch

from gpt_lightning.data.corpus import CACHE_ENV, Corpus

REPO = Path(__file__).resolve().parents[1]

# Local harness tasks load through `datasets`, which reads its cache folder when first imported: a
# private one, set before any test module imports it, so no test writes ~/.cache/huggingface.
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="gpt-lightning-tests-datasets-")
atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)

# The Ctrl-C tests send a real SIGINT, as a terminal does. A shell without job control (a script) starts
# its `&` commands with SIGINT ignored, which Python and the tests' subprocesses keep: put Python's
# handler back.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Under `-n auto` each core runs a test worker: one torch thread each, in the processes the tests
# launch too, or the workers' thread pools spin against each other for the same cores.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# A model small enough to train in a second per few steps on 2 CPU cores.
TINY_MODEL = dict(n_layer=2, n_head=2, n_embd=32, compile=False)
# The suite's one compiled shape, with batches of 2 x 32 tokens in bf16-mixed: the configs' test and the
# CLI's shrink to it too, so inductor's cache compiles its kernels once for them all.
COMPILED_TINY = dict(TINY_MODEL, n_layer=1, compile=True)
# A plain Trainer's one CPU step with nothing beside it (no logger, checkpoint, bar, summary, validation).
ONE_QUIET_CPU_STEP = dict(
    accelerator="cpu",
    max_steps=1,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    limit_val_batches=0,
)
# The CLI's tiny run: `gpt-lightning fit` on configs/tiny-cpu.yaml, shrunk to one narrow eager block, batches of
# 2 x 16 tokens, no validation, sample or throughput warm-up. A test that needs another value overrides it by name.
TINY_CPU = str(REPO / "configs" / "tiny-cpu.yaml")
TINY_FIT = ["fit", "--config", TINY_CPU]
TINY_RUN = {
    "model.n_layer": 1,
    "model.n_head": 2,
    "model.n_embd": 32,
    "model.compile": False,
    "model.val_sample_tokens": 0,
    "data.batch_size": 2,
    "data.block_size": 16,
    "trainer.limit_val_batches": 0,
    "throughput.warmup_steps": 0,
}


def tiny_flags(overrides: dict[str, object] | None = None) -> list[str]:
    """TINY_RUN with ``overrides`` (dotted names, as TINY_RUN's; None leaves a flag out) as command-line flags:
    ``tiny_flags({"data.block_size": 32})`` ends ``["--data.block_size", "32", ...]``; booleans as true/false."""
    settings = {**TINY_RUN, **(overrides or {})}
    return [
        word
        for key, value in settings.items()
        if value is not None
        for word in (f"--{key}", str(value).lower() if isinstance(value, bool) else str(value))
    ]


# configs/modern-tiny-cpu.yaml's switches as CLI flags, for tests that keep their own config's sizes; its
# sliding windows left out (the tests that name them add them; test_configs_as_written trains the preset).
MODERN_FLAGS = [
    "--model.bias",
    "false",
    "--model.rotary",
    "true",
    "--model.norm",
    "rmsnorm",
    "--model.norm_affine",
    "false",
    "--model.qk_norm",
    "true",
    "--model.activation",
    "relu2",
    "--model.tie_embeddings",
    "false",
    "--model.zero_init_proj",
    "true",
    "--model.logit_softcap",
    "15.0",
    "--model.value_embeddings",
    "true",
]
# The switch between the blocks (nanochat's residual scalars): in no preset, added to the modern run of the
# exact-resume test (the FSDP2 plan tests set it in-process).
ARCH_FLAGS = ["--model.residual_scalars", "true"]


# The slowest test files (seconds of one worker, measured on 2 cores from an empty compile cache, 2026-12-06), run
# first: with `-n auto --dist loadfile` the small files then fill in at the end and both workers end
# together. xdist's own order (the files with most tests first) left the one-test GPU-run smoke and
# the README walkthrough for last, with one core idle for a minute.
SLOWEST_FIRST = (
    "test_configs_as_written.py",  # 128 s: every config compiled as written
    "test_fsdp.py",  # 118 s: 2- and 4-process FSDP2
    "test_preemption.py",  # 117 s: signals to DDP and FSDP2 ranks
    "test_gpu_run.py",  # 105 s: benchmarks/gpu_run.sh --dry-run, its steps and the deadline
    "test_fault_mixture.py",  # 70-110 s: 6 launches of 2 ranks, a fault each
    "test_dead_rank.py",  # 75 s, 30 of them waiting on a process-group timeout
    "test_ddp.py",  # 51 s: torchrun, restarts
    "test_benchmarks.py",  # 33 s
    "test_resume_relayout.py",  # 32 s: 2-process resumes on another number of processes
    "test_generate.py",  # 31 s: compiled decoding, frozen and compiled again
    "test_launched_ranks.py",  # 26 s: ranks ended and waited for, a fork pool, Ctrl-C in a Python caller
    "test_readme.py",  # 26 s
    "test_attention.py",  # 24 s: two processes compiling into one fresh cache
)


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    missing = set(SLOWEST_FIRST) - {path.name for path in Path(__file__).parent.glob("test_*.py")}
    assert not missing, f"conftest.SLOWEST_FIRST names files that are gone: {sorted(missing)}"
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the others keep their order


@pytest.fixture(scope="session", autouse=True)
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh token cache, exported as GPT_LIGHTNING_CACHE_DIR: no test reads or writes ~/.cache."""
    path = tmp_path_factory.mktemp("cache")
    os.environ[CACHE_ENV] = str(path)
    return path


@pytest.fixture(scope="session")
def shakespeare() -> str:
    """The packaged tiny Shakespeare text."""
    return Corpus.tiny_shakespeare().open_text().read()


@pytest.fixture
def small_text(tmp_path: Path, shakespeare: str) -> Path:
    """A file of about 12k tokens: the first 50,000 characters of tiny Shakespeare."""
    path = tmp_path / "small.txt"
    path.write_text(shakespeare[:50_000])
    return path


@pytest.fixture
def in_process_group():
    """For a test that runs ModelParallelStrategy (or any process group) in the pytest process.
    Lightning exports MASTER_PORT and friends into os.environ and leaves its process group (and
    the TCP store on that port) behind: later subprocess launches would inherit the taken port."""
    import torch.distributed as dist

    saved = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)
