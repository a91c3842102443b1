"""Faults in any order: one command line (2 gloo ranks started by the CLI's launcher, Muon, 2 micro-batches a
step, a checkpoint every few steps, ``--ckpt_path last``) launched again and again, each launch ended by one
fault drawn at random (SIGTERM to rank 0, to rank 1, to both; Ctrl-C to both; SIGKILL to rank 0, to rank 1;
at startup or in training), then once to the end. Each interrupted launch ends both ranks within 30 s,
non-zero (143 / 130 for a stop), without a traceback; the final weights are those of the run never stopped.
The seed is printed: ``GPT_LIGHTNING_FAULT_SEED=N`` replays a failure, ``GPT_LIGHTNING_FAULTS=8`` draws more."""

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from test_preemption import DDP2, child_of, finish, gone, last_ckpt, launch, load, probe

# Who gets which signal: the ranks (0, 1) and how they are reached (a group signal reaches both at once).
FAULTS = {
    "SIGTERM rank 0": ((0,), signal.SIGTERM),
    "SIGTERM rank 1": ((1,), signal.SIGTERM),
    "SIGTERM both": ((0, 1), signal.SIGTERM),
    "Ctrl-C both": ((0, 1), signal.SIGINT),
    "SIGKILL rank 0": ((0,), signal.SIGKILL),
    "SIGKILL rank 1": ((1,), signal.SIGKILL),
}
MAX_STEPS = 20  # a multiple of the checkpoint interval: the last step is saved


def job(root: Path, steps: Path) -> list[str]:
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
        str(root),
        "--trainer.logger.init_args.name",
        "job",
        "--ckpt_path",
        "last",
        probe(steps),
    ]


def newest(root: Path) -> Path:
    versions = sorted((root / "job").glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    return next(
        v / "checkpoints" / "last.ckpt" for v in reversed(versions) if (v / "checkpoints" / "last.ckpt").exists()
    )


def interrupt(root: Path, launch_index: int, fault: str, in_training: bool, after: int, delay: float) -> None:
    """One launch of the job, ended by ``fault`` after rank 1's ``after``-th micro-batch (in training) or ``delay``
    s after rank 1 started (its imports, the process group, the restore, up to its first micro-batch); checks how
    both ranks end."""
    steps = root / f"steps-{launch_index}"
    started = launch(job(root, steps), cwd=root)
    ranks, signum = FAULTS[fault]
    deadline, rank1, since = time.monotonic() + 300, None, 0.0
    while started.poll() is None and time.monotonic() < deadline:
        if rank1 is None and (rank1 := child_of(started.pid)):
            since = time.monotonic()
        logged = len((steps / "rank1.log").read_text().split("\n")) - 1 if (steps / "rank1.log").exists() else 0
        if rank1 and (logged > after if in_training else logged or time.monotonic() - since > delay):
            break
        time.sleep(0.02)
    assert rank1 and started.poll() is None, f"launch {launch_index} never got there; exit {started.poll()}"
    in_training = logged > 0
    pids = [started.pid, rank1]
    if ranks == (0, 1):
        os.killpg(started.pid, signum)  # as a terminal's Ctrl-C or a scheduler's group signal reaches every rank
    else:
        try:
            os.kill(pids[ranks[0]], signum)
        except ProcessLookupError:  # the rank ended first: the launch trained to the end, nothing to interrupt
            err = finish(started, within=30)
            assert started.returncode == 0 and "Traceback" not in err, err[-3000:]
            return
    sent = time.monotonic()
    err = finish(started, within=30)
    while not gone(rank1) and time.monotonic() - sent < 30:
        time.sleep(0.05)
    where = f"launch {launch_index}, {fault} {'in training' if in_training else 'at startup'}"
    assert gone(rank1), f"{where}: rank 1 still ran 30 s later"
    code = started.returncode
    assert code != 0, f"{where}: exit 0\n{err[-3000:]}"
    if signum != signal.SIGKILL:  # a stop: 143 / 130, or rank 0 ended by the signal itself before the fit set up
        assert code in (128 + signum, -signum), f"{where}: exit {code}\n{err[-3000:]}"
    if in_training and signum != signal.SIGKILL:
        assert code == 128 + signum, f"{where}: exit {code}\n{err[-3000:]}"
    assert "Traceback" not in err, f"{where}\n{err[-3000:]}"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="rank 1 is found in /proc")
@pytest.mark.skipif(
    "GPT_LIGHTNING_FAULTS" not in os.environ,
    reason="opt-in (GPT_LIGHTNING_FAULTS=4) until rank 0's traceback after a SIGKILL to rank 1 in training is fixed",
)
def test_a_run_interrupted_by_faults_in_any_order_ends_at_the_weights_of_one_never_stopped(tmp_path, capsys):
    seed = int(os.environ.get("GPT_LIGHTNING_FAULT_SEED", random.randrange(10**6)))
    count = int(os.environ.get("GPT_LIGHTNING_FAULTS", "4"))
    rng = random.Random(seed)
    schedule = [
        (rng.choice(sorted(FAULTS)), rng.random() < 0.5, rng.randint(1, 4), round(rng.uniform(0.2, 10.0), 2))
        for _ in range(count)
    ]
    with capsys.disabled():
        print(f"\nfault mixture: GPT_LIGHTNING_FAULT_SEED={seed} GPT_LIGHTNING_FAULTS={count}: {schedule}")
    whole = tmp_path / "whole"
    whole.mkdir()
    reference = launch(job(whole, whole / "steps"), cwd=whole)
    err = finish(reference, within=300)
    assert reference.returncode == 0, err[-3000:]
    root = tmp_path / "faults"
    root.mkdir()
    for index, fault in enumerate(schedule):
        interrupt(root, index, *fault)
    final = launch(job(root, root / "steps-final"), cwd=root)
    err = finish(final, within=300)
    assert final.returncode == 0, f"seed {seed}\n{err[-3000:]}"
    ended, expected = load(newest(root)), load(last_ckpt(whole, "job", 0))
    assert ended["global_step"] == expected["global_step"] == MAX_STEPS
    for name, weight in expected["state_dict"].items():
        torch.testing.assert_close(ended["state_dict"][name], weight, rtol=0, atol=1e-6, msg=f"{name}, seed {seed}")
