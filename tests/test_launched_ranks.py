"""How a process of ``gpt-lightning`` ends outside training: a rank Lightning's launcher started dies with
it, or exits at once where it is already gone (torchrun's ranks are left to torchrun); rank 0, done, waits
30 s in all for the ranks it started and says which failed; a Ctrl-C outside training is one line and
``SystemExit(130)`` that a caller of ``main()`` catches. Through ``gpt-lightning fit`` on 2 processes:
tests/test_preemption.py (rank 0 killed) and test_dead_rank.py."""

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO
from test_ddp import fit_args

from gpt_lightning.cli import main


def subprocess_env() -> dict[str, str]:
    """This process's environment when called (after conftest's private token cache is set), and the repo's path."""
    return {**os.environ, "PYTHONPATH": str(REPO)}


RANK = """
import os, sys, time
from gpt_lightning.stopping.launched_ranks import die_with_launcher
die_with_launcher()
print(os.getpid(), flush=True)
time.sleep(60)
"""
# What Lightning's launcher does: its own LOCAL_RANK 0, the child's 1, the environment passed on.
LAUNCHER = f"""
import os, subprocess, sys, time
os.environ["GPT_LIGHTNING_LAUNCHER_PID"] = str(os.getpid())
subprocess.Popen([sys.executable, "-c", {RANK!r}], env={{**os.environ, "LOCAL_RANK": "1"}})
time.sleep(60)
"""

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@linux
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
def test_a_launched_rank_dies_with_its_launcher(signum):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER], env=subprocess_env(), stdout=subprocess.PIPE, text=True
    )
    rank = int(launcher.stdout.readline())  # the rank's print: it is past die_with_launcher
    try:
        os.kill(launcher.pid, signum)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 5
        while not gone(rank) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert gone(rank)
    finally:
        if not gone(rank):
            os.kill(rank, signal.SIGKILL)


@linux
def test_a_rank_whose_launcher_is_already_gone_exits_at_once():
    ended = subprocess.Popen(["true"])
    ended.wait()  # its pid no longer runs: the launcher died before the rank got this far
    env = {**subprocess_env(), "LOCAL_RANK": "1", "GPT_LIGHTNING_LAUNCHER_PID": str(ended.pid)}
    result = subprocess.run([sys.executable, "-c", RANK], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stdout == ""
    assert (
        "gpt-lightning: the process that started this rank" in result.stderr
        and "has ended; so does this one." in result.stderr
    )


@linux
def test_torchrun_s_ranks_and_a_launcher_s_own_process_are_left_alone():
    check = RANK.replace(
        "print(os.getpid(), flush=True)\ntime.sleep(60)",
        (
            "import ctypes; got = ctypes.c_int(-1)\n"
            "ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0)\n"  # PR_GET_PDEATHSIG
            "print(got.value, os.environ['GPT_LIGHTNING_LAUNCHER_PID'] == str(os.getpid()))"
        ),
    )
    parent = str(os.getpid())  # this process is their parent: only the check of who launched them tells
    for extra in ({"LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "1"}, {"LOCAL_RANK": "0"}, {}):
        env = {**subprocess_env(), **extra, "GPT_LIGHTNING_LAUNCHER_PID": parent}
        result = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=60)
        assert result.stdout.split() == ["0", "True"], (extra, result.stderr)
    env = {**subprocess_env(), "LOCAL_RANK": "1", "GPT_LIGHTNING_LAUNCHER_PID": parent}
    result = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == [str(int(signal.SIGKILL)), "True"], result.stderr  # a launched rank


def test_rank_0_waits_30_s_in_all_for_the_ranks_it_started_not_30_s_each(monkeypatch, capsys):
    """Three ranks that hang after rank 0 finished. Before, rank 0 waited the limit for each in turn (8 ranks:
    4 minutes) and exited 0."""
    from gpt_lightning.stopping.launched_ranks import LaunchedRanks

    monkeypatch.setattr("gpt_lightning.stopping.launched_ranks.FINISH_WAIT_S", 2.0)
    ranks = LaunchedRanks()
    ranks.started([subprocess.Popen(["sleep", "60"]) for _ in range(3)])
    started = time.monotonic()
    assert ranks.finish(0) is True
    assert time.monotonic() - started < 4  # one 2 s deadline, not three
    assert all(proc.returncode == -signal.SIGKILL for proc in ranks.procs)
    pids = [proc.pid for proc in ranks.procs]
    assert capsys.readouterr().err == (
        "gpt-lightning: error: this rank finished, but "
        + "; ".join(f"rank {rank} (pid {pid}) still ran 2 s later and was killed" for rank, pid in enumerate(pids, 1))
        + ": its log says why.\n"
    )


def test_a_rank_killed_by_a_signal_is_said_to_have_nothing_in_its_log(monkeypatch, capsys):
    """Rank 1 killed by SIGKILL (the out-of-memory killer), by SIGTERM (a scheduler's signal at startup, before any
    handler of ours) or stopped by Ctrl-C while rank 0 runs, then after rank 0 stopped. Before, rank 0's lines sent
    the user to that rank's log, which was empty, and a signal that stops a run ended it with 1."""
    from gpt_lightning.stopping.launched_ranks import LaunchedRanks

    monkeypatch.setattr(os, "_exit", lambda code: (_ for _ in ()).throw(SystemExit(code)))
    for signum in (signal.SIGKILL, signal.SIGTERM):
        killed = subprocess.Popen(["sleep", "60"])
        killed.send_signal(signum)
        killed.wait()
        with pytest.raises(SystemExit) as stopped:
            LaunchedRanks().ended([killed])
        line, what = capsys.readouterr().err, f"saw rank 1 (pid {killed.pid}) end: killed by {signum.name})"
        if signum == signal.SIGKILL:
            assert stopped.value.code == 1
            assert f"{what}: SIGKILL is a signal from outside the run" in line and "nothing in its log" in line
            assert "says why" not in line
        else:
            assert stopped.value.code == 143
            assert line.startswith(f"gpt-lightning: stopped by SIGTERM (Lightning's launcher {what} before training")
    ctrl_c = subprocess.Popen(["sh", "-c", "exit 130"])
    ctrl_c.wait()
    with pytest.raises(SystemExit) as stopped:
        LaunchedRanks().ended([ctrl_c])
    assert stopped.value.code == 130 and "gpt-lightning: stopped by SIGINT" in capsys.readouterr().err
    killed = subprocess.Popen(["sleep", "60"])
    killed.terminate()
    killed.wait()
    ranks = LaunchedRanks()
    ranks.started([killed, subprocess.Popen(["sh", "-c", "exit 3"])])
    assert ranks.finish(143) is True
    assert capsys.readouterr().err == (
        f"gpt-lightning: error: this rank stopped (exit code 143), but rank 1 (pid {killed.pid}) ended with killed by "
        "SIGTERM (a signal from outside the run (a scheduler, a user, the out-of-memory killer), which leaves nothing "
        f"in its log); rank 2 (pid {ranks.procs[1].pid}) ended with exit code 3: its log says why.\n"
    )


def test_a_rank_that_fails_after_rank_0_finished_fails_the_job(small_text, tmp_path):
    """Rank 1 exits 3 a second after rank 0 finished its fit. Before, the job exited 0: rank 0's launcher
    watcher held back (the run had claimed its end) and its wait did not look at how the rank ended."""
    fail = {"class_path": "ddp_probe.FailAfterRank0", "init_args": {"out_dir": str(tmp_path / "marks")}}
    args = [
        *fit_args(small_text, tmp_path, max_steps=3),
        "--trainer.devices",
        "2",
        f"--trainer.callbacks+={json.dumps(fail)}",
    ]
    result = subprocess.run(
        [sys.executable, "-m", "gpt_lightning", *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])},
    )
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    rank1 = (tmp_path / "marks" / "rank1").read_text()
    assert (
        last
        == f"gpt-lightning: error: this rank finished, but rank 1 (pid {rank1}) ended with exit code 3: its log says why."
    )


def test_a_ctrl_c_outside_training_is_a_system_exit_a_python_caller_catches(small_text, tmp_path):
    """A script (a notebook) calling ``main()``: a Ctrl-C while a user's callback waits 4.5 s in one C call (a
    store), and one inside the fit before ``Preemption`` listens (as in ``prepare_data``). Each is one line and
    ``SystemExit(130)`` that the caller catches; the process goes on with its handlers and no thread of ours.
    Before, the first ended the process 3 s after the signal (``os._exit(130)``): the caller's ``except`` never
    ran (a notebook's kernel died)."""
    fit = fit_args(small_text, tmp_path, max_steps=1)
    fit[fit.index("--trainer.strategy") + 1] = "auto"
    body = f"""
import signal, threading
from gpt_lightning.cli import main
before = signal.getsignal(signal.SIGINT)
for callback in ("SlowInit", "CtrlCAtSetup"):
    try:
        main([*{fit!r}, "--trainer.callbacks+=preemption_probe." + callback])
    except SystemExit as stop:
        print("caught", stop.code, flush=True)
print(signal.getsignal(signal.SIGINT) is before, [t.name for t in threading.enumerate() if t is not threading.current_thread()])
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    result = subprocess.run(
        [sys.executable, "-c", body], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert (result.returncode, result.stdout) == (0, "caught 130\ncaught 130\nTrue []\n"), result.stderr[-3000:]
    line = (
        "gpt-lightning: stopped by Ctrl-C (SIGINT). Run the same command with --ckpt_path last "
        "to resume from the last checkpoint saved, if any."
    )
    assert [text for text in result.stderr.splitlines() if text.startswith("gpt-lightning:")] == [line, line]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["eval", "tokenize", "sample", "export"])
def test_a_ctrl_c_in_our_own_commands_says_only_that_it_stopped(command, monkeypatch, capsys):
    """A real SIGINT while the command runs, ``main()`` called as a notebook calls it. Before, each said "Run
    the same command again (with --ckpt_path last)", which means nothing there."""

    def runs(argv):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)

    monkeypatch.setitem(sys.modules, f"gpt_lightning.commands.{command}", SimpleNamespace(main=runs))
    with pytest.raises(SystemExit) as stopped:
        main([command])
    assert stopped.value.code == 130
    assert capsys.readouterr().err == "gpt-lightning: stopped by Ctrl-C (SIGINT).\n"


def test_a_ctrl_c_during_the_imports_lets_them_finish_then_stops_in_one_line(monkeypatch, capsys):
    """Raised inside an import, a KeyboardInterrupt left modules half made (numpy's, under torch's), and what ran
    next failed on them with a traceback: torchrun passing a terminal's Ctrl-C to ranks still importing (the
    fault mixture's seed 16). It is raised once the imports end."""
    imported = []

    def slow_import(name):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.5)  # the signal is handled here, inside the import
        imported.append(name)
        return SimpleNamespace(main=lambda argv: pytest.fail("the command ran after a Ctrl-C"))

    monkeypatch.setattr(importlib, "import_module", slow_import)
    with pytest.raises(SystemExit) as stopped:
        main(["sample"])
    assert stopped.value.code == 130 and imported == ["gpt_lightning.commands.sample"]
    assert capsys.readouterr().err == "gpt-lightning: stopped by Ctrl-C (SIGINT).\n"


def test_a_collective_that_finds_a_rank_gone_says_how_it_ended_and_a_stop_signal_stops_the_run(monkeypatch, capsys):
    """Rank 0's collective fails first (the watcher polls every 5 s): a rank SIGTERM ended before its fit set up
    stops the run as the watcher would (143, the others killed), one SIGKILL ended is named. Before, both were
    "the log of the rank that failed says why", exit 1."""
    from gpt_lightning.stopping.launched_ranks import LaunchedRanks, signal_that_ended_a_rank

    def exit_now(code):
        raise SystemExit(code)

    monkeypatch.setattr(LaunchedRanks, "current", None)
    monkeypatch.setattr(os, "_exit", exit_now)
    for signum, live in ((signal.SIGKILL, None), (signal.SIGTERM, subprocess.Popen(["sleep", "60"]))):
        ended = subprocess.Popen(["sh", "-c", f"kill -{signum.name[3:]} $$"])
        ended.wait()
        LaunchedRanks().started([ended, live] if live else [ended])
        if live is None:
            assert signal_that_ended_a_rank() == "SIGKILL"
            continue
        with pytest.raises(SystemExit) as stopped:
            signal_that_ended_a_rank()
        assert stopped.value.code == 143 and live.wait(5) == -signal.SIGKILL
        assert capsys.readouterr().err.startswith(
            f"gpt-lightning: stopped by SIGTERM (rank 1 (pid {ended.pid}) ended: killed by SIGTERM) before training"
        )
