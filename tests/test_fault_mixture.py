"""Faults in any order: one command line (2 gloo ranks, Muon, 2 micro-batches a step, a checkpoint every few
steps, ``--ckpt_path last``, its logs on a small disk of their own) launched again and again, each launch
started by the CLI's launcher or by torchrun and ended by one fault drawn at random (SIGTERM to rank 0, to
rank 1, to both; Ctrl-C; SIGKILL to rank 0, to rank 1; a full disk; at startup or in training), then once to
the end. Each interrupted launch ends both ranks within 30 s, non-zero (143 / 130 for a stop of the CLI's
launch), without a traceback from any rank; the final weights are those of the run never stopped. The seed
is printed: ``GPT_LIGHTNING_FAULT_SEED=N`` replays a failure, ``GPT_LIGHTNING_FAULTS=8`` draws more."""

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_atomic_checkpoints import mount_tmpfs
from test_preemption import DDP2, finish, gone, last_ckpt, launch, load, probe, subprocess_env

# Who gets which signal: the ranks (0, 1), or the whole job (a scheduler's signal to every process of it, or a
# terminal's Ctrl-C, which reaches the foreground process group: under torchrun, torchrun alone, which ends
# its ranks). "full disk": the logs' disk filled up, then freed before the next launch.
FAULTS = {
    "SIGTERM rank 0": ((0,), signal.SIGTERM),
    "SIGTERM rank 1": ((1,), signal.SIGTERM),
    "SIGTERM both": ((0, 1), signal.SIGTERM),
    "Ctrl-C": ((0, 1), signal.SIGINT),
    "SIGKILL rank 0": ((0,), signal.SIGKILL),
    "SIGKILL rank 1": ((1,), signal.SIGKILL),
    "full disk": ((), None),
}
LAUNCHERS = ("cli", "torchrun")
MAX_STEPS = 20  # a multiple of the checkpoint interval: the last step is saved


def job(logs: Path, steps: Path) -> list[str]:
    return [
        *DDP2,
        "--model.optimizer",
        "muon",
        "--data.tokens_per_step",
        "128",  # 2 processes x 2 x 16 x 2 micro-batches
        "--trainer.max_steps",
        str(MAX_STEPS),
        "--checkpoint.every_n_train_steps",
        "4",
        "--trainer.logger.init_args.save_dir",
        str(logs),
        "--trainer.logger.init_args.name",
        "job",
        "--ckpt_path",
        "last",
        probe(steps),
    ]


def start(launcher: str, args: list[str], root: Path, index: int | str) -> subprocess.Popen:
    """The job as the CLI's launcher (``--trainer.devices 2``) or torchrun starts it; torchrun's ranks write their
    output to files of their own (its ``--redirects``), apart from torchrun's."""
    if launcher == "cli":
        return launch(args, cwd=root)
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.Popen(
        [
            sys.executable,
            *torchrun,
            "--redirects",
            "3",
            "--log-dir",
            str(root / f"torchrun-{index}"),
            "-m",
            "gpt_lightning",
            *args,
        ],  # fmt: skip
        env={**subprocess_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},  # docs/resume.md's torchrun launch
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def ranks_of(started: subprocess.Popen, launcher: str) -> list[int] | None:
    """The pids of rank 0 and rank 1 once both run: under the CLI, the CLI and the rank it started; under
    torchrun, its two children running gpt_lightning, by their ``LOCAL_RANK``."""
    children = {}
    for tasks in Path(f"/proc/{started.pid}/task").glob("*/children"):
        for child in tasks.read_text().split():
            try:
                if b"gpt_lightning" in Path(f"/proc/{child}/cmdline").read_bytes():
                    environ = dict(
                        entry.split(b"=", 1)
                        for entry in Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
                        if b"=" in entry
                    )
                    if b"LOCAL_RANK" in environ:  # a rank; not another child that names the package
                        children[int(environ[b"LOCAL_RANK"])] = int(child)
            except (FileNotFoundError, ProcessLookupError):
                continue
    if launcher == "cli":
        return [started.pid, children[1]] if 1 in children else None
    return [children[0], children[1]] if len(children) == 2 else None


def fill(disk: Path) -> None:
    """Takes every free byte of ``disk``, as a full disk does."""
    with open(disk / "filler", "wb") as filler:
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        os.posix_fallocate(filler.fileno(), 0, max(free, 1))


def interrupt(replay: str, root: Path, logs: Path, index: int, launcher: str, fault: str, in_training: bool,
              after: int, delay: float) -> None:  # fmt: skip
    """One launch of the job, ended by ``fault`` after rank 1's ``after``-th micro-batch (in training) or ``delay``
    s after both ranks started (their imports, the process group, the restore, up to the first micro-batch);
    checks how both ranks end."""
    steps = root / f"steps-{index}"
    started = start(launcher, job(logs, steps), root, index)
    ranks, signum = FAULTS[fault]
    deadline, pids, since, logged = time.monotonic() + 300, None, 0.0, 0
    while started.poll() is None and time.monotonic() < deadline:
        if pids is None and (pids := ranks_of(started, launcher)):
            since = time.monotonic()
        logged = len((steps / "rank1.log").read_text().split("\n")) - 1 if (steps / "rank1.log").exists() else 0
        if pids and (logged > after if in_training else logged or time.monotonic() - since > delay):
            break
        time.sleep(0.02)
    assert pids and started.poll() is None, f"{replay}: launch {index} never got there; exit {started.poll()}"
    in_training = logged > 0
    where = f"{replay}: launch {index} ({launcher}), {fault} {'in training' if in_training else 'at startup'}"
    try:
        if fault == "full disk":
            fill(logs)
        elif ranks == (0, 1) and launcher == "cli":
            os.killpg(started.pid, signum)  # the CLI's ranks share its process group
        elif ranks == (0, 1):
            os.killpg(started.pid, signum)  # torchrun; its ranks are each in a session of their own
            for pid in pids if signum == signal.SIGTERM else ():  # a scheduler signals every process of the job
                os.kill(pid, signum)
        else:
            os.kill(pids[ranks[0]], signum)
    except ProcessLookupError:  # the rank ended first: the launch trained to the end, nothing to interrupt
        pass
    sent = time.monotonic()
    err = finish(started, within=45)
    while not all(gone(pid) for pid in pids) and time.monotonic() - sent < 30:
        time.sleep(0.05)
    (logs / "filler").unlink(missing_ok=True)  # the user frees the disk before launching again
    assert all(gone(pid) for pid in pids), f"{where}: a rank still ran 30 s later"
    code = started.returncode
    rank_logs = [path.read_text() for path in sorted((root / f"torchrun-{index}").rglob("stderr.log"))]
    assert launcher == "cli" or len(rank_logs) == 2, f"{where}: torchrun wrote {len(rank_logs)} rank logs"
    output = err if launcher == "cli" else "".join(rank_logs)
    assert "Traceback" not in output, f"{where}\n{output[-3000:]}"
    if code == 0:  # only a launch that had nothing left to train, or trained to the end before its fault
        assert load(newest(logs))["global_step"] == MAX_STEPS, f"{where}: exit 0\n{err[-3000:]}"
        return
    if launcher == "cli" and signum in (signal.SIGTERM, signal.SIGINT):
        # a stop: 143 / 130, or rank 0 ended by the signal itself before its fit set up
        assert code in (128 + signum, -signum), f"{where}: exit {code}\n{err[-3000:]}"
        if in_training:
            assert code == 128 + signum, f"{where}: exit {code}\n{err[-3000:]}"


def newest(logs: Path) -> Path:
    versions = sorted((logs / "job").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    return next(
        v / "checkpoints" / "last.ckpt" for v in reversed(versions) if (v / "checkpoints" / "last.ckpt").exists()
    )


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="the ranks are found in /proc")
def test_a_run_interrupted_by_faults_in_any_order_ends_at_the_weights_of_one_never_stopped(tmp_path, capsys):
    seed = int(os.environ.get("GPT_LIGHTNING_FAULT_SEED", random.randrange(10**6)))
    count = int(os.environ.get("GPT_LIGHTNING_FAULTS", "4"))
    root = tmp_path / "faults"
    logs = root / "logs"
    try:
        mount_tmpfs(logs, f"{24 * (count + 3)}m")  # a 19.5 MB checkpoint a launch, and one being saved
        faults = sorted(FAULTS)
    except pytest.skip.Exception as no_disk:
        logs.mkdir(parents=True, exist_ok=True)
        faults = sorted(set(FAULTS) - {"full disk"})
        with capsys.disabled():
            print(f"\nfault mixture without a full disk: {no_disk}")
    rng = random.Random(seed)
    schedule = [
        (rng.choice(LAUNCHERS), rng.choice(faults), rng.random() < 0.5, rng.randint(1, 4), round(rng.uniform(0.2, 10.0), 2))
        for _ in range(count)
    ]  # fmt: skip
    replay = f"GPT_LIGHTNING_FAULT_SEED={seed} GPT_LIGHTNING_FAULTS={count}"  # in each failure's message (xdist)
    with capsys.disabled():
        print(f"\nfault mixture: {replay}: {schedule}")
    try:
        whole = tmp_path / "whole"
        whole.mkdir()
        reference = launch(job(whole, whole / "steps"), cwd=whole)
        err = finish(reference, within=300)
        assert reference.returncode == 0, err[-3000:]
        for index, fault in enumerate(schedule):
            interrupt(replay, root, logs, index, *fault)
        final = start(rng.choice(LAUNCHERS), job(logs, root / "steps-final"), root, "final")
        err = finish(final, within=300)
        assert final.returncode == 0, f"{replay}\n{err[-3000:]}"
        ended, expected = load(newest(logs)), load(last_ckpt(whole, "job", 0))
    finally:
        subprocess.run(["umount", str(logs)], check=False, capture_output=True)
    assert ended["global_step"] == expected["global_step"] == MAX_STEPS
    for name, weight in expected["state_dict"].items():
        torch.testing.assert_close(
            ended["state_dict"][name],
            weight,
            rtol=0,
            atol=1e-6,
            msg=lambda text, name=name: f"{replay}: {name}: {text}",
        )
