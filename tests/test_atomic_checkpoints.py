"""A crash or a full disk during a save keeps the previous checkpoint: the CLI on the quick start's
config, its logs on a small tmpfs of their own (another filesystem than $TMPDIR, as `logs/` on NFS
or Lustre is), killed at random moments while saving every step, and filled until a save fails."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from conftest import MODERN_FLAGS, REPO, TINY_FIT, tiny_flags
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.io import TorchCheckpointIO

from gpt_lightning.cli import main
from gpt_lightning.interop.checkpoint import gpt_from_checkpoint, read_checkpoint
from gpt_lightning.training.checkpoint_io import AtomicCheckpointIO, use_atomic_checkpoints

# The quick start's config shrunk in size and steps, eager. A checkpoint is 19.5 MB (mostly the
# 50257 x 32 embedding and its AdamW moments); 1 x 16 tokens a step make saving most of a step. The config's
# throughput warm-up is kept: these runs end inside it and write no throughput.json on the small disk.
SHRUNK = tiny_flags({"data.batch_size": 1, "throughput.warmup_steps": None})


# FSDP2 as the README gives it, on one CPU process (a mesh of one; tests/test_fsdp.py runs 2 and 4).
FSDP = [
    "--config",
    str(REPO / "configs/fsdp2.yaml"),
    "--trainer.devices",
    "1",
    "--trainer.accelerator",
    "cpu",
    "--trainer.precision",
    "32-true",
]


def mount_tmpfs(path: Path, size: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
    )
    if result.returncode != 0:
        pytest.skip(f"needs a small tmpfs of its own and cannot mount one here: {result.stderr.strip()}")


@pytest.fixture
def small_disk(tmp_path):
    """A factory of tmpfs mounts under tmp_path, each unmounted at the end of the test."""
    mounted: list[Path] = []

    def mount(name: str, size: str) -> Path:
        path = tmp_path / name
        mount_tmpfs(path, size)
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], check=False)


def cli(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gpt_lightning",
        *TINY_FIT,
        *SHRUNK,
        *args,
    ]


def environment(tmpdir: Path) -> dict[str, str]:
    tmpdir.mkdir()
    return {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmpdir)}


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())


def orphans_in(tmpdir: Path) -> list[str]:
    """Files in $TMPDIR other than tiktoken's cache of the GPT-2 encoding (data-gym-cache) and the module torch
    2.9's distributed RPC writes there on import (torch's own, left by any killed process)."""
    ours = [f for f in files_under(tmpdir) if not f.startswith("data-gym-cache/")]
    return [f for f in ours if not f.endswith("/_remote_module_non_scriptable.py")]


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")  # Lightning's note on resume
def test_a_full_disk_fails_the_save_in_one_line_and_keeps_the_previous_checkpoint(
    small_disk, tmp_path, monkeypatch, capsys
):
    """In this process (a subprocess would only add its start-up): the CLI's own main, its exit code and stderr."""
    logs = small_disk("logs", "32m")  # room for one checkpoint and the logs, not for two
    (tmp_path / "tmpdir").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmpdir"))  # what $TMPDIR sets
    with pytest.raises(SystemExit) as exit_info:
        main(
            cli(
                "--trainer.max_steps",
                "4",
                "--checkpoint.every_n_train_steps",
                "2",
                "--trainer.logger.init_args.save_dir",
                str(logs),
            )[3:]
        )
    err = capsys.readouterr().err
    run = logs / "tiny-cpu" / "version_0"
    ckpt = run / "checkpoints" / "last.ckpt"
    assert exit_info.value.code == 2, err[-3000:]
    last_line = err.strip().splitlines()[-1]
    assert last_line.startswith(
        f"gpt-lightning: error: Cannot save the checkpoint {ckpt}: its folder {ckpt.parent} has no room for it ("
    ), err[-3000:]
    assert "bytes needed" in last_line and "the previous checkpoint there is kept" in last_line
    assert "Traceback" not in err
    # The step-2 checkpoint is whole, nothing else is left on the disk or in $TMPDIR...
    assert torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"] == 2
    assert [f for f in files_under(logs) if f.startswith("tiny-cpu/version_0/checkpoints")] == [
        "tiny-cpu/version_0/checkpoints/last.ckpt"
    ]
    assert not [f for f in files_under(logs) if ".tmp" in f]
    assert orphans_in(tmp_path / "tmpdir") == []
    # ...and resumes.
    main(
        cli(
            "--ckpt_path",
            str(ckpt),
            "--trainer.max_steps",
            "3",
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "more-logs"),
        )[3:]
    )
    again = tmp_path / "more-logs" / "tiny-cpu" / "version_0" / "checkpoints" / "last.ckpt"
    assert torch.load(again, map_location="cpu", weights_only=False)["global_step"] == 3


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")  # the writer thread's traceback
def test_a_full_disk_under_the_logs_is_one_line_too(small_disk, capsys):
    """Full before the first save: TensorBoard's writer thread meets it as the fit starts, and the main thread at
    its next write. Before, the thread's traceback and then the main thread's were printed."""
    logs = small_disk("logs", "1m")
    with open(logs / "filler", "wb") as filler:
        filler.write(b"\0" * (os.statvfs(logs).f_bavail * os.statvfs(logs).f_frsize))
    with pytest.raises(SystemExit) as exit_info:
        main(cli("--trainer.max_steps", "2", "--trainer.logger.init_args.save_dir", str(logs))[3:])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == (
        "gpt-lightning: error: No space left on device. Free some space on that disk, then run the same command "
        "with --ckpt_path last to resume."
    ), err[-3000:]


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_a_full_disk_fails_an_fsdp2_save_in_one_line_and_keeps_the_previous_folder(
    small_disk, tmp_path, capsys, in_process_group
):
    logs = small_disk("logs", "32m")  # room for one checkpoint folder and the logs, not for two
    with pytest.raises(SystemExit) as exit_info:
        main(
            cli(
                *FSDP,
                "--trainer.max_steps",
                "4",
                "--checkpoint.every_n_train_steps",
                "2",
                "--trainer.logger.init_args.save_dir",
                str(logs),
            )[3:]
        )
    err = capsys.readouterr().err
    ckpt = logs / "tiny-cpu" / "version_0" / "checkpoints" / "last.ckpt"
    assert exit_info.value.code == 2, err[-3000:]
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(
            f"gpt-lightning: error: Cannot save the checkpoint {ckpt}: its folder {ckpt.parent} has no room for it (about "
        )
    )
    assert ckpt.is_dir() and [p.name for p in ckpt.parent.iterdir()] == ["last.ckpt"]
    assert read_checkpoint(ckpt, weights=False)["global_step"] == 2
    assert gpt_from_checkpoint(ckpt) is not None


def signature(path: Path) -> tuple[int, int] | None:
    """What changes when a save lands: the path's inode (a rename) or its newest file time."""
    try:
        stat = path.stat()
        files = [p.stat().st_mtime_ns for p in path.rglob("*")] if path.is_dir() else []
    except FileNotFoundError:
        return None
    return stat.st_ino, max([stat.st_mtime_ns, *files])


def size(path: Path) -> int:
    """A checkpoint's bytes, a folder's summed; 0 where it is (or a file of it went) missing."""
    try:
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
    except FileNotFoundError:
        return 0


def kill_during_saves(args: list[str], ckpt: Path, tmp_path: Path, kills: int) -> None:
    """Run the CLI saving ``ckpt`` every step and SIGKILL it ``kills`` times, each relaunch resuming
    ``ckpt``: at a random moment after its first save, or at once if ``ckpt`` is seen partly written
    (smaller than whole). Each time the checkpoint must still be whole (its relaunch resumes it)."""
    env = environment(tmp_path / "tmpdir")
    rng = random.Random(34)
    whole = None
    for kill in range(kills):
        resume = ["--ckpt_path", str(ckpt)] if ckpt.exists() else []
        before = signature(ckpt)
        log = tmp_path / f"stderr-{kill}.txt"
        with open(log, "w") as stderr:
            proc = subprocess.Popen(
                cli(
                    "--trainer.max_steps",
                    "100000",
                    "--checkpoint.every_n_train_steps",
                    "1",
                    "--checkpoint.dirpath",
                    str(ckpt.parent),
                    *args,
                    *resume,
                ),
                env=env,
                cwd=tmp_path,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
            )
        try:
            deadline = time.monotonic() + 300
            while signature(ckpt) == before:  # until this process has saved once
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "no checkpoint saved in 300 s"
                time.sleep(0.005)
            whole = whole or size(ckpt)
            kill_at = time.monotonic() + rng.uniform(0.0, 1.5)
            while time.monotonic() < kill_at and size(ckpt) >= 0.9 * whole:
                time.sleep(0.001)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        assert gpt_from_checkpoint(ckpt) is not None  # a partial file or folder fails here
        # At most the killed save's own partial file is beside it: the next save removes it.
        assert len([p for p in ckpt.parent.iterdir() if p.name != ckpt.name]) <= 1
    assert orphans_in(tmp_path / "tmpdir") == []  # nothing orphaned in $TMPDIR


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
def test_a_kill_at_any_moment_of_a_save_leaves_last_ckpt_whole_and_it_resumes(small_disk, tmp_path):
    """SIGKILLed at a random moment of its saves, the run leaves a whole last.ckpt, which the same
    command with --ckpt_path resumes and trains on. The run is the modern model with Muon (docs/modern.md),
    the largest file checkpoint of the suite (about 58 MB: the head and a value embedding are tables
    as large as the embedding, each with its AdamW moments), and its architecture and groups resume."""
    logs = small_disk("logs", "160m")  # room for two checkpoints (the one written beside the old)
    ckpt = logs / "checkpoints" / "last.ckpt"
    modern = [*MODERN_FLAGS, "--model.optimizer", "muon"]
    kill_during_saves([*modern, "--trainer.logger.init_args.save_dir", str(logs)], ckpt, tmp_path, 1)
    step = read_checkpoint(ckpt, weights=False)["global_step"]
    main(
        cli(
            *modern,
            "--ckpt_path",
            str(ckpt),
            "--trainer.max_steps",
            str(step + 1),
            "--trainer.logger.init_args.save_dir",
            str(tmp_path / "resumed"),
        )[3:]
    )
    (resumed,) = (tmp_path / "resumed").glob("*/version_0/checkpoints/last.ckpt")
    assert read_checkpoint(resumed, weights=False)["global_step"] == step + 1
    assert gpt_from_checkpoint(resumed).config.value_embeddings


def test_a_kill_during_an_fsdp2_save_leaves_a_folder_that_resumes(small_disk, tmp_path):
    logs = small_disk("logs", "128m")
    kill_during_saves(
        [*FSDP, "--trainer.logger.init_args.save_dir", str(logs)], logs / "checkpoints" / "last.ckpt", tmp_path, 1
    )
    assert (logs / "checkpoints" / "last.ckpt").is_dir()  # the sharded folder, not a file


def test_a_plain_trainer_gets_atomic_saves_and_a_users_own_plugin_is_kept(tmp_path):
    trainer = Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path)
    use_atomic_checkpoints(trainer)
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO

    class MyIO(TorchCheckpointIO):
        pass

    trainer = Trainer(accelerator="cpu", logger=False, default_root_dir=tmp_path, plugins=[MyIO()])
    use_atomic_checkpoints(trainer)
    assert type(trainer.strategy.checkpoint_io) is MyIO


def test_a_remote_path_is_saved_as_lightning_saves_it():
    """fsspec URLs (s3://, gs://; here memory://) go to Lightning's own TorchCheckpointIO path."""
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 7}, "memory://run/checkpoints/last.ckpt")
    assert io.load_checkpoint("memory://run/checkpoints/last.ckpt")["global_step"] == 7


class Killed(BaseException):
    """A SIGKILL's stand-in: raised at one step of a save, and at every step after it (no cleanup runs)."""


class KillAt:
    """Counts the file operations of ``SwappedCheckpointStrategy.save_checkpoint`` after its write
    (and the leftovers' removal before it), and kills the save before operation ``at`` (None: never)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, at: int | None, exchange: bool) -> None:
        from gpt_lightning.scaling import swapped_checkpoints as swap

        self.at, self.done, self.dead = at, [], False
        replace = self.step("replace", os.replace)

        class Os:  # the module's os, its replace counted
            def __getattr__(self, name: str):
                return replace if name == "replace" else getattr(os, name)

        monkeypatch.setattr(swap, "os", Os())
        for name in ("_remove", "_flush", "sync_folder"):
            monkeypatch.setattr(swap, name, self.step(name, getattr(swap, name)))
        monkeypatch.setattr(
            swap, "_exchange", self.step("exchange", swap._exchange if exchange else lambda a, b: False)
        )

    def step(self, name: str, real):
        def counted(*args):
            if self.dead or len(self.done) == self.at:
                self.dead = True
                raise Killed(name)
            self.done.append(name)
            return real(*args)

        return counted


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, no group
@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_a_kill_at_each_moment_of_an_fsdp2_swap_resumes_from_the_newest_whole_checkpoint(
    tmp_path, monkeypatch, exchange
):
    """Killed before each file operation of a swap (renameat2's exchange, or NFS's two renames),
    ``--ckpt_path last`` finds a whole checkpoint: the new one once the old is out of ``last.ckpt``,
    as after the first of two renames (it used to put the old one back, and the next save deleted
    the new one); the next save then leaves ``last.ckpt`` alone in the folder."""
    from gpt_lightning.lightning_cli import GPTLightningCLI
    from gpt_lightning.scaling.swapped_checkpoints import SwappedCheckpointStrategy

    def save(last: Path, step: int, at: int | None = None) -> list[str]:
        with monkeypatch.context() as patch:
            kill = KillAt(patch, at, exchange)
            try:
                strategy.save_checkpoint(
                    {"state_dict": {"w": torch.full((4,), float(step))}, "global_step": step}, last
                )
            except Killed:
                pass
        return kill.done

    strategy = SwappedCheckpointStrategy()
    moments = save(tmp_path / "plan" / "last.ckpt", 1) and save(tmp_path / "plan" / "last.ckpt", 2)
    assert moments.count("replace") == (0 if exchange else 2)  # exchanged: one call; else two renames
    for at in range(len(moments) + 1):
        run = tmp_path / str(at)
        last = run / "version_0" / "checkpoints" / "last.ckpt"
        save(last, 1)
        save(last, 2, at)
        newest = 2 if {"replace", "exchange" if exchange else "replace"} & set(moments[:at]) else 1  # once moved
        assert GPTLightningCLI._newest_last_checkpoint(run) == last
        assert torch.load(last / "meta.pt")["global_step"] == newest, (at, moments[:at])
        save(last, 3)
        assert [p.name for p in last.parent.iterdir()] == ["last.ckpt"]
        assert torch.load(last / "meta.pt")["global_step"] == 3


def test_a_run_killed_between_the_two_renames_of_a_swap_resumes_from_the_checkpoint_set_aside(tmp_path):
    """Where the filesystem has no atomic exchange (NFS), a swap is two renames; killed between them,
    the whole previous checkpoint is under .last.ckpt.old, which --ckpt_path last used not to see."""
    from gpt_lightning.lightning_cli import GPTLightningCLI

    checkpoints = tmp_path / "version_3" / "checkpoints"
    checkpoints.mkdir(parents=True)
    (checkpoints / ".last.ckpt.old").mkdir()  # an FSDP2 folder of shards
    (checkpoints / ".last.ckpt.old" / ".metadata").write_bytes(b"shards")
    assert GPTLightningCLI._newest_last_checkpoint(tmp_path) == checkpoints / "last.ckpt"
    assert (checkpoints / "last.ckpt" / ".metadata").read_bytes() == b"shards"
