"""How a process of ``gpt-lightning`` ends outside training, without torch (cheap): a rank Lightning's
launcher started dies with it, or exits at once where it is already gone; torchrun's ranks are left to
torchrun; a stop signal before ``Preemption``'s handler ends the CLI in one line, 143 / 130. Through
``gpt-lightning fit`` on 2 processes: tests/test_preemption.py (rank 0 killed) and test_dead_rank.py."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

ENV = {**os.environ, "PYTHONPATH": str(REPO)}
RANK = """
import os, sys, time
from gpt_lightning.scaling.launched_ranks import die_with_launcher
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
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], env=ENV, stdout=subprocess.PIPE, text=True)
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
    env = {**ENV, "LOCAL_RANK": "1", "GPT_LIGHTNING_LAUNCHER_PID": str(ended.pid)}
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
        env = {**ENV, **extra, "GPT_LIGHTNING_LAUNCHER_PID": parent}
        result = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=60)
        assert result.stdout.split() == ["0", "True"], (extra, result.stderr)
    env = {**ENV, "LOCAL_RANK": "1", "GPT_LIGHTNING_LAUNCHER_PID": parent}
    result = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=60)
    assert result.stdout.split() == [str(int(signal.SIGKILL)), "True"], result.stderr  # a launched rank


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_before_preemption_s_handler_ends_the_cli_in_one_line(signum):
    body = (
        "import sys, time\nfrom gpt_lightning.scaling.launched_ranks import StopSignalsBeforeOurs\n"
        "with StopSignalsBeforeOurs():\n    print('ready', flush=True)\n    time.sleep(60)\n"
    )
    started = subprocess.Popen(
        [sys.executable, "-c", body], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert started.stdout.readline() == "ready\n"
    os.kill(started.pid, signum)
    err = started.communicate(timeout=30)[1]
    assert started.returncode == 128 + signum, err
    assert err == (
        f"gpt-lightning: stopped by {signal.Signals(signum).name} outside training (starting or finishing): "
        "nothing new to save. Run the same command again (with --ckpt_path last) to start or resume.\n"
    )


def test_a_stop_signal_ends_the_cli_while_its_main_thread_waits_in_a_store():
    """Rank 0 at startup, in C++ waiting for the others to join its store: Python's handler cannot run
    there (before, the process waited for the store's timeout); the thread ends it, GRACE_S later."""
    body = (
        "from datetime import timedelta\nimport torch.distributed as dist\n"
        "from gpt_lightning.scaling.launched_ranks import StopSignalsBeforeOurs\n"
        "with StopSignalsBeforeOurs():\n    print('ready', flush=True)\n"
        "    dist.TCPStore('127.0.0.1', 0, world_size=2, is_master=True, timeout=timedelta(seconds=120), wait_for_workers=True)\n"
    )
    started = subprocess.Popen(
        [sys.executable, "-c", body], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert started.stdout.readline() == "ready\n"
    time.sleep(0.5)  # inside the store's wait
    os.kill(started.pid, signal.SIGTERM)
    sent = time.monotonic()
    err = started.communicate(timeout=60)[1]
    assert started.returncode == 143 and time.monotonic() - sent < 20, err[-2000:]
    assert err.startswith("gpt-lightning: stopped by SIGTERM outside training"), err[-2000:]


def test_a_process_forked_meanwhile_keeps_the_handler_it_had():
    """A tokenizing pool's worker forked while the CLI starts: Ctrl-C there is its KeyboardInterrupt, not our line."""
    body = (
        "import os, signal, sys, time\nfrom gpt_lightning.scaling.launched_ranks import StopSignalsBeforeOurs\n"
        "with StopSignalsBeforeOurs():\n    pid = os.fork()\n    if pid == 0:\n"
        "        try:\n            os.kill(os.getpid(), signal.SIGINT); time.sleep(5)\n"
        "        except KeyboardInterrupt:\n            os._exit(7)\n        os._exit(0)\n"
        "    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", body], env=ENV, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, "7\n", "")


def test_a_ctrl_c_while_main_starts_leaves_a_python_caller_running_as_it_was():
    """A script (a notebook) calling ``main()``: a Ctrl-C as it starts is its SystemExit 130, and the process
    goes on as before the call. Before, the stop-signal thread ended it ``GRACE_S`` after ``main()`` had
    returned (``os._exit(130)``: a notebook's kernel died), and the launcher's pid stayed in its environment."""
    body = f"""
import os, signal, threading, time
from gpt_lightning.cli import main
from gpt_lightning.scaling.launched_ranks import StopSignalsBeforeOurs
before = signal.getsignal(signal.SIGINT)
def ctrl_c():  # once main() listens
    while signal.getsignal(signal.SIGINT) is before:
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=ctrl_c).start()
try:
    main(["fit", "--config", {str(REPO / "configs/tiny-cpu.yaml")!r}])
except SystemExit as stop:
    print(type(stop).__name__, stop.code, flush=True)
time.sleep(StopSignalsBeforeOurs.GRACE_S + 1)
print(signal.getsignal(signal.SIGINT) is before, signal.set_wakeup_fd(-1), os.environ.get("GPT_LIGHTNING_LAUNCHER_PID"),
      [thread.name for thread in threading.enumerate() if thread is not threading.current_thread()])
"""
    result = subprocess.run([sys.executable, "-c", body], env=ENV, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, "StoppedOutsideTraining 130\nTrue -1 None []\n"), result.stderr
    assert result.stderr.startswith("gpt-lightning: stopped by SIGINT outside training"), result.stderr


def test_a_stopped_cli_that_takes_long_to_unwind_in_python_is_not_cut_short():
    """The handler ran, so the main thread runs Python: the CLI unwinds at its pace (Lightning's teardown);
    only a main thread that cannot run the handler, stuck in C++, is ended ``GRACE_S`` after the signal."""
    body = (
        "import os, signal, time\nfrom gpt_lightning.scaling.launched_ranks import StopSignalsBeforeOurs, StoppedOutsideTraining\n"
        "StopSignalsBeforeOurs.GRACE_S = 0.3\nwith StopSignalsBeforeOurs():\n    try:\n"
        "        os.kill(os.getpid(), signal.SIGTERM); time.sleep(5)\n    except StoppedOutsideTraining:\n"
        "        time.sleep(1)  # unwinding\nprint('unwound', flush=True)\n"
    )
    result = subprocess.run([sys.executable, "-c", body], env=ENV, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (0, "unwound\n"), result.stderr
