"""A scheduler's SIGTERM (or Ctrl-C) during ``gpt-lightning fit``: the run saves ``last.ckpt`` at the
end of the optimizer step in flight, exits 143 (130), and the same command relaunched ends at the very
weights of a run never stopped. Real signals, sent while a chosen micro-batch of an accumulated step
runs (one process: the CLI in this one; DDP: real processes), or while the ranks of a DDP run
restore a checkpoint or run the sanity check (to one rank or to both); and a plain Trainer reusing
the callback, as in a notebook."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY_FIT, TINY_MODEL, tiny_flags
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from gpt_lightning import GPTLightningModule, Preempted, Preemption, TokenStreamDataModule
from gpt_lightning.cli import main


def subprocess_env() -> dict[str, str]:
    """This process's environment when called (after conftest's private token cache is set), and the repo's path."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}


# configs/tiny-cpu.yaml (bf16-mixed) shrunk in size and steps; 3 micro-batches of 2 x 16 a step.
TINY = [
    *TINY_FIT,
    *tiny_flags({"data.tokens_per_step": 96, "trainer.max_steps": 6, "trainer.enable_progress_bar": False}),
]
MICRO = 3


def probe(out_dir: Path) -> str:
    return "--trainer.callbacks+=" + json.dumps(
        {"class_path": "preemption_probe.MicroBatchLog", "init_args": {"out_dir": str(out_dir)}}
    )


def signal_during(
    process: subprocess.Popen,
    log: Path,
    step: int,
    micro: int,
    signum: int,
    pid_of=lambda pid: None,
    per_step: int = MICRO,
) -> None:
    """Send ``signum`` while micro-batch ``micro`` (of ``per_step``) of optimizer step ``step`` runs
    (the probe pauses there), to ``pid_of(the pid the log names)``, or to ``process``."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        lines = log.read_text().split("\n") if log.exists() else []
        for line in filter(None, lines):
            at_step, batch_idx, pid = map(int, line.split())
            if at_step == step and batch_idx % per_step == micro:
                os.kill(pid_of(pid) or process.pid, signum)
                return
        time.sleep(0.02)
    pytest.fail(f"step {step} micro-batch {micro} never ran; exit {process.poll()}")


def launch(args: list[str], cwd: Path | None = None) -> subprocess.Popen:
    """The CLI in a session of its own, so that ``finish`` can end it and its DDP children."""
    return subprocess.Popen(
        [sys.executable, "-m", "gpt_lightning", *args],
        env=subprocess_env(),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(process: subprocess.Popen, within: float = 120) -> str:
    """stderr, once ``process`` exits; a run that does not within ``within`` s (Lightning's own
    handling hangs when one DDP rank alone is signalled) is killed with its children and fails."""
    try:
        return process.communicate(timeout=within)[1]
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"still running {within} s after the signal")


def last_ckpt(root: Path, name: str, version: int) -> Path:
    return root / name / f"version_{version}" / "checkpoints" / "last.ckpt"


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("whole")
    main([*TINY, "--trainer.logger.init_args.save_dir", str(root), "--trainer.logger.init_args.name", "whole"])
    return last_ckpt(root, "whole", 0)


class SignalDuringMicroBatch(Callback):
    """Sends ``signum`` to this process as micro-batch ``micro`` (of ``MICRO``) of optimizer step ``step``
    starts; ``sent``: when."""

    sent = 0.0

    def __init__(self, step: int, micro: int, signum: int = int(signal.SIGTERM)) -> None:
        self.step, self.micro, self.signum = step, micro, signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and batch_idx % MICRO == self.micro:
            SignalDuringMicroBatch.sent = time.monotonic()
            os.kill(os.getpid(), self.signum)


class SignalDuringSanity(Callback):
    """Sends SIGTERM to this process as the sanity check's second batch starts."""

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if trainer.sanity_checking and batch_idx == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def test_ctrl_c_mid_accumulation_saves_the_step_and_the_same_command_resumes_exactly(tmp_path, uninterrupted, capfd):
    """Lightning alone exits 1 on Ctrl-C with no checkpoint. (SIGTERM takes the same path: the DDP and
    FSDP2 tests below send it.)"""
    signum, code = signal.SIGINT, 130
    job = [
        *TINY,
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        "--trainer.logger.init_args.name",
        "job",
        "--ckpt_path",
        "last",
    ]
    signal_at = {
        "class_path": "test_preemption.SignalDuringMicroBatch",
        "init_args": {"step": 2, "micro": 1, "signum": signum},
    }
    previous = signal.getsignal(signum)
    try:  # in this process (one process: a launch adds nothing); a real signal
        with pytest.raises(SystemExit) as stopped:
            main([*job, f"--trainer.callbacks+={json.dumps(signal_at)}"])
    finally:
        signal.signal(signum, previous)
    err = capfd.readouterr().err
    assert stopped.value.code == code, err[-3000:]
    assert time.monotonic() - SignalDuringMicroBatch.sent < 30  # well inside a scheduler's grace period
    ckpt = last_ckpt(tmp_path, "job", 0)
    assert f"stopped by {signal.Signals(signum).name} at step 3; saved {ckpt}" in err
    assert load(ckpt)["global_step"] == 3  # the step in flight finished (its third micro-batch ran) and was saved
    # The stopped segment's throughput, its last step included (Preemption runs after the monitor).
    assert json.loads((tmp_path / "job" / "version_0" / "throughput.json").read_text())["measured_steps"] == 3
    main(job)  # the job's requeue: the very same command
    resumed = load(last_ckpt(tmp_path, "job", 1))
    expected = load(uninterrupted)
    assert resumed["global_step"] == expected["global_step"] == 6
    differ = [k for k in expected["state_dict"] if not torch.equal(expected["state_dict"][k], resumed["state_dict"][k])]
    assert not differ, differ


class SignalDuringSave(Callback):
    """Sends SIGTERM to this process while the checkpoint of step ``step`` is saved; lists the steps saved."""

    def __init__(self, step: int) -> None:
        self.step, self.saves = step, []

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.saves.append(trainer.global_step)
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_a_reused_preemption_does_not_save_a_step_twice_and_forgets_its_stop(tmp_path, small_text):
    """A plain Trainer, as in a notebook. A SIGTERM during the periodic save of step 2 stops there,
    without writing step 2 again (before: a second full save at step 3, inside the grace period).
    The handlers go back to what they were; the same callback in a second fit trains (before: it
    stopped that fit at once)."""
    preemption, heard = Preemption(), []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: heard.append(signum))

    def fit(*callbacks):
        checkpoint = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_last=True, save_top_k=0)
        trainer = Trainer(
            accelerator="cpu",
            max_steps=4,
            logger=False,
            limit_val_batches=0,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[*callbacks, preemption, checkpoint],
        )
        trainer.fit(
            GPTLightningModule(**TINY_MODEL, block_size=32),
            TokenStreamDataModule(str(small_text), batch_size=2, block_size=32),
        )
        return trainer

    try:
        probe = SignalDuringSave(step=2)
        with pytest.raises(Preempted) as stopped:
            fit(probe)
        assert (stopped.value.code, stopped.value.step, stopped.value.ckpt_path) == (
            143,
            2,
            str(tmp_path / "last.ckpt"),
        )
        assert probe.saves == [2]
        assert load(tmp_path / "last.ckpt")["global_step"] == 2
        os.kill(os.getpid(), signal.SIGINT)  # the fit is over: the handler from before it hears this
        time.sleep(0.01)
        assert heard == [signal.SIGINT]
        assert fit().global_step == 4
        assert signal.getsignal(signal.SIGINT) is not preemption._handle
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)
        assert heard == [signal.SIGINT] * 2
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_sigterm_during_the_sanity_check_exits_143_with_nothing_to_save(tmp_path, capfd):
    """Lightning's handler, in place until the first step, ended the run at the sanity check's next
    batch with exit code 0 and no message: a job script took the job for finished. The CLI in this
    process (one process: a launch adds nothing), the signal a real one."""
    job = [
        *TINY,
        "--trainer.limit_val_batches",
        "3",
        "--trainer.num_sanity_val_steps",
        "3",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        "--ckpt_path",
        "last",
        "--trainer.callbacks+=test_preemption.SignalDuringSanity",
    ]
    previous = signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(SystemExit) as stopped:
            main(job)
    finally:
        signal.signal(signal.SIGTERM, previous)
    err = capfd.readouterr().err
    assert stopped.value.code == 143, err[-3000:]
    assert "SIGTERM received; stopping before the first training step." in err
    assert "stopped by SIGTERM before this run trained a step: nothing new to save" in err
    assert not list(tmp_path.rglob("*.ckpt"))


def test_a_user_s_fork_pool_neither_ends_the_run_nor_hangs_it(tmp_path):
    """A ``fork`` pool in a user's callback (as ``datasets.map(num_proc=2)`` makes one), left while its workers
    are busy, which SIGTERMs them: in the fit's ``setup``, and at the first step with ``Preemption``'s handler in
    place. Before, the first ended the CLI 3 s later with exit 143 (the workers' signals woke the parent's
    stop-signal thread through the socket they inherited), and the second hung (the workers' copy of our handler
    only recorded the SIGTERM)."""
    job = [*TINY, "--trainer.max_steps", "1", "--trainer.logger.init_args.save_dir", str(tmp_path)]
    started = launch([*job, "--trainer.callbacks+=preemption_probe.ForkPool"], cwd=tmp_path)
    err = finish(started, within=60)
    assert started.returncode == 0, err[-3000:]
    assert "gpt-lightning: stopped" not in err


# Two DDP processes (gloo), one micro-batch of 2 x 16 tokens per rank and step.
DDP2 = [
    *TINY,
    "--trainer.strategy",
    "ddp",
    "--trainer.devices",
    "2",
    "--trainer.precision",
    "32-true",
    "--data.tokens_per_step",
    "64",
    "--trainer.max_steps",
    "3",
]


@pytest.fixture(scope="module")
def step_1(tmp_path_factory) -> Path:
    """A checkpoint at step 1 to resume from, made once, on one process."""
    root = tmp_path_factory.mktemp("step1")
    main(
        [
            *TINY,
            "--data.tokens_per_step",
            "64",
            "--trainer.max_steps",
            "1",
            "--trainer.logger.init_args.save_dir",
            str(root),
            "--trainer.logger.init_args.name",
            "s1",
        ]
    )
    return last_ckpt(root, "s1", 0)


# Each rank choice and each moment once, not their product: every case launches two DDP ranks (13-15 s).
@pytest.mark.parametrize(
    ("moment", "ranks"),
    [("sanity", (0,)), ("train_start", (1,)), ("restore", (0, 1))],
    ids=["rank0-sanity", "rank1-train-start", "both-restore"],
)
def test_a_sigterm_while_ddp_ranks_start_stops_every_rank_at_train_start(tmp_path, step_1, moment, ranks):
    """Each rank is held at the moment (the probe) while the test signals some of them. Before, a
    signal during the restore killed that rank (no handler yet: the job exited 137, or rank 0's death
    left rank 1 hanging), one during the sanity check stopped only the rank that got it, and one to rank 1
    alone between the restore and train start (Lightning's handler in place) broadcast from inside the
    handler, a collective rank 0 never entered: rank 1 aborted in gloo or both hung."""
    hold = {"class_path": "preemption_probe.HoldAt", "init_args": {"out_dir": str(tmp_path / "hold"), "moment": moment}}
    at = (
        ["--ckpt_path", str(step_1)]
        if moment != "sanity"
        else ["--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "1"]
    )
    started = launch(
        [*DDP2, *at, "--trainer.logger.init_args.save_dir", str(tmp_path), f"--trainer.callbacks+={json.dumps(hold)}"],
        cwd=tmp_path,
    )
    marks = [tmp_path / "hold" / f"{moment}-rank{rank}" for rank in range(2)]
    deadline = time.monotonic() + 300
    while not all(mark.exists() for mark in marks) and started.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    for rank in ranks:
        os.kill(int(marks[rank].read_text()), signal.SIGTERM)
    time.sleep(0.3)  # handled while held
    (tmp_path / "hold" / "go").touch()
    released = time.monotonic()
    err = finish(started, within=60)
    assert started.returncode == 143, err[-3000:]
    assert time.monotonic() - released < 30
    assert err.count("stopped by SIGTERM before this run trained a step: nothing new to save") == 1, err[-3000:]
    for rank in ranks:
        assert f"SIGTERM received (rank {rank}); stopping before the first training step." in err
    assert [(tmp_path / "hold" / f"exit-rank{rank}").read_text() for rank in range(2)] == ["Preempted 143"] * 2


def child_of(pid: int) -> int | None:
    """The rank Lightning's launcher in process ``pid`` started (its main thread's child running gpt_lightning)."""
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for child in children.read_text().split() if children.exists() else []:
        try:
            if b"gpt_lightning" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
        except FileNotFoundError:
            continue
    return None


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # a zombie no one reaped yet has ended


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize(
    ("moment", "signum"),
    [("startup", signal.SIGTERM), ("startup", signal.SIGKILL), ("restore", signal.SIGKILL)],
    ids=["startup-TERM", "startup-KILL", "restore-KILL"],
)
def test_rank_1_ends_within_seconds_of_rank_0_whatever_ended_it(tmp_path, step_1, moment, signum):
    """Signal to rank 0 alone (Lightning's launcher), 1.5 s after it started rank 1 (both initializing
    the process group) or while both restore the checkpoint. Before, rank 0 died (SIGTERM by its default
    action) and rank 1 waited for a store that no longer existed, 400+ s. (A SIGTERM during the restore
    stops every rank at train start: the test above.)"""
    hold = {"class_path": "preemption_probe.HoldAt", "init_args": {"out_dir": str(tmp_path / "hold"), "moment": moment}}
    started = launch(
        [
            *DDP2,
            "--ckpt_path",
            "last" if moment == "startup" else str(step_1),
            "--trainer.logger.init_args.save_dir",
            str(tmp_path),
            f"--trainer.callbacks+={json.dumps(hold)}",
        ],
        cwd=tmp_path,
    )
    marks = [tmp_path / "hold" / f"{moment}-rank{rank}" for rank in range(2)]
    deadline, rank1 = time.monotonic() + 300, None
    try:
        while started.poll() is None and time.monotonic() < deadline:
            rank1 = (
                child_of(started.pid)
                if moment == "startup"
                else (int(marks[1].read_text()) if all(mark.exists() for mark in marks) else None)
            )
            if rank1:
                break
            time.sleep(0.02)
        assert rank1, f"rank 1 never started; exit {started.poll()}"
        time.sleep(1.5 if moment == "startup" else 0.3)
        os.kill(started.pid, signum)
        sent = time.monotonic()
        while not gone(rank1) and time.monotonic() - sent < 10:
            time.sleep(0.05)
        assert gone(rank1), "rank 1 outlived rank 0 by 10 s"
        err = finish(started, within=30)
        assert started.returncode == -signum, err[-3000:]  # SIGTERM's default action outside training: at once
        assert "Traceback" not in err, err[-3000:]
    finally:
        if rank1 and not gone(rank1):
            os.kill(rank1, signal.SIGKILL)


@pytest.mark.parametrize("side_group", [True, False], ids=["side-group", "no-side-group"])
def test_a_sigterm_to_one_ddp_rank_stops_both_at_one_step_with_no_per_micro_batch_sync(tmp_path, side_group):
    """2 processes (gloo), 2 micro-batches a step, SIGTERM to rank 1 only (Lightning's launcher's child).
    Both stop at the same optimizer step, one consistent last.ckpt is written, rank 0 exits 143; and no
    step broadcasts or reads anything back: one CPU all-reduce of the stop flag per optimizer step.
    Lightning alone broadcast a flag and read it on the host at every micro-batch, and exited 0.
    Where gloo cannot form Preemption's own group, the run says so in one line and agrees over its
    default group (before, it ended at train start with gloo's traceback)."""
    counter = {"class_path": "host_reads.CollectiveCounter", "init_args": {"out_dir": str(tmp_path / "counts")}}
    job = [
        *TINY,
        "--trainer.strategy",
        "ddp",
        "--trainer.devices",
        "2",
        "--trainer.precision",
        "32-true",
        "--data.tokens_per_step",
        "128",
        "--trainer.max_steps",
        "20",
        "--trainer.log_every_n_steps",
        "1000",
        "--checkpoint.every_n_train_steps",
        "1000",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
        "--trainer.logger.init_args.name",
        "job",
        "--ckpt_path",
        "last",
        probe(tmp_path / "steps"),
        f"--trainer.callbacks+={json.dumps(counter)}",
    ]
    if not side_group:
        job.append(f"--trainer.callbacks+={json.dumps({'class_path': 'preemption_probe.NoGlooInterface'})}")
    started = launch(job, cwd=tmp_path)
    signal_during(
        started,
        tmp_path / "steps" / "rank1.log",
        step=3,
        micro=1,
        signum=signal.SIGTERM,
        pid_of=lambda pid: pid,
        per_step=2,
    )
    err = finish(started)
    assert started.returncode == 143, err[-3000:]
    fallback = [line for line in err.splitlines() if "could not form the CPU (gloo) group" in line]
    if side_group:
        assert not fallback
    else:
        assert len(fallback) == 1 and "Unable to find address for: nonexistent0" in fallback[0], err[-3000:]
        assert "agreeing over the run's own process group instead" in fallback[0]
    records = [json.loads((tmp_path / "counts" / f"rank{r}.json").read_text()) for r in range(2)]
    # Flags posted at the end of step 3 (global_step 4) are read at the end of the next: both stop there.
    assert [r["steps"] for r in records] == [5, 5]
    assert load(last_ckpt(tmp_path, "job", 0))["global_step"] == 5
    assert "stopped by SIGTERM at step 5" in err
    for record in records:
        counts = {int(k): v for k, v in record["counts"].items()}
        assert sorted(counts) == [0, 1, 2, 3, 4]
        assert all(counts[k] == {"all_reduce": 1} for k in range(4)), counts
        # The stop step adds the checkpoint save's own barriers and broadcasts (the path, the save).
        assert counts[4]["all_reduce"] == 1, counts
        reads = {int(k): n for k, n in record["reads"].items() if n}
        # The first step measures FLOPs, the stop step checks the weights are finite before saving;
        # no other step reads a value back.
        assert set(reads) <= {0, 4}, reads


SLURM = {
    "SLURM_NTASKS": "1",
    "SLURM_JOB_NAME": "gpt",
    "SLURM_JOB_ID": "77",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "localhost",
}


def test_under_slurm_lightning_s_auto_requeue_is_off_and_a_stale_hpc_checkpoint_is_refused(
    tmp_path, monkeypatch, capsys, in_process_group
):
    """Lightning's auto-requeue saves hpc_ckpt_N.ckpt in the working directory on SIGUSR1, and resumes
    any later run started there from it, unasked. Under the CLI it is off (SIGTERM saves last.ckpt), and
    a stale one is refused in one line rather than taking the run over."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from gpt_lightning.lightning_cli import GPTLightningCLI

    for key, value in SLURM.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    args = [*TINY[1:], "--trainer.logger.init_args.save_dir", str(tmp_path)]
    # What Lightning's signal connector reads to decide on SIGUSR1 requeueing (any strategy).
    environment = GPTLightningCLI(args=args, run=False).trainer._accelerator_connector.cluster_environment
    assert isinstance(environment, SLURMEnvironment) and environment.auto_requeue is False
    (tmp_path / "hpc_ckpt_1.ckpt").write_bytes(b"an old run's")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args])
    assert exit_info.value.code == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("gpt-lightning: error:")]
    assert f"{tmp_path / 'hpc_ckpt_1.ckpt'} (Lightning's SLURM auto-requeue checkpoint)" in line
    # torchrun inside the allocation (srun torchrun ...): its ranks and world size, not SLURM's one task.
    for key, value in {
        "TORCHELASTIC_RUN_ID": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "GROUP_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29511",
    }.items():
        monkeypatch.setenv(key, value)
    environment = GPTLightningCLI(args=args, run=False).trainer._accelerator_connector.cluster_environment
    assert type(environment).__name__ == "TorchElasticEnvironment"


def test_under_fsdp2_a_sigterm_saves_the_sharded_checkpoint_and_the_same_command_resumes_exactly(
    tmp_path, in_process_group
):
    """configs/fsdp2.yaml (ModelParallelStrategy, one CPU process): the checkpoint is a folder of
    shards written by every rank; stopped mid-accumulation and relaunched, the run ends at the weights
    of the run never stopped."""
    from gpt_lightning.interop.checkpoint import read_checkpoint

    fsdp2 = [
        *TINY,
        "--config",
        str(REPO / "configs" / "fsdp2.yaml"),
        "--trainer.accelerator",
        "cpu",
        "--trainer.devices",
        "1",
        "--model.compile",
        "false",
        "--trainer.logger.init_args.save_dir",
        str(tmp_path),
    ]
    main([*fsdp2, "--trainer.logger.init_args.name", "whole"])
    job = [*fsdp2, "--trainer.logger.init_args.name", "job", "--ckpt_path", "last"]
    signal_at = {"class_path": "test_preemption.SignalDuringMicroBatch", "init_args": {"step": 2, "micro": 1}}
    previous = signal.getsignal(signal.SIGTERM)
    try:  # in this process, as the two fits around it (one process: a launch adds nothing); a real signal
        with pytest.raises(SystemExit) as stopped:
            main([*job, f"--trainer.callbacks+={json.dumps(signal_at)}"])
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopped.value.code == 143
    assert read_checkpoint(last_ckpt(tmp_path, "job", 0), weights=False)["global_step"] == 3
    main(job)  # the requeue: the same command
    expected, got = (
        read_checkpoint(last_ckpt(tmp_path, name, version)) for name, version in (("whole", 0), ("job", 1))
    )
    assert got["global_step"] == expected["global_step"] == 6
    differ = [k for k in expected["state_dict"] if not torch.equal(expected["state_dict"][k], got["state_dict"][k])]
    assert not differ, differ
