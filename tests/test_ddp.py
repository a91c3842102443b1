"""One job on two CPU processes (gloo): under Lightning's DDP launcher on one "node", and as two
torchrun launches on two "nodes" of this machine. Disjoint windows, global loss and throughput; and
the same job under torchrun --max-restarts, a rank killed, ending at the same weights."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from conftest import MODERN_FLAGS, TINY_FIT, tiny_flags
from ddp_probe import check_one_job_on_two_ranks
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_cli import REPO, run_cli
from test_eval_callback import TASK, write_task

from gpt_lightning.data.tokenizer import gpt2_encoding

ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}


def fit_args(small_text, tmp_path, max_steps=6, log_every_n_steps=1):
    probe = {"class_path": "ddp_probe.RecordRank", "init_args": {"out_dir": str(tmp_path / "ranks")}}
    return [
        *TINY_FIT,
        "--trainer.strategy",
        "ddp",
        *tiny_flags(
            {
                "trainer.accelerator": "cpu",
                "trainer.precision": "32-true",
                "data.data_path": small_text,
                "data.cache_dir": tmp_path / "cache",
                "data.block_size": 32,
                "trainer.max_steps": max_steps,
                "trainer.log_every_n_steps": log_every_n_steps,
                "throughput.warmup_steps": 2,
                "trainer.logger.init_args.save_dir": tmp_path / "tb",
            }
        ),
        f"--trainer.callbacks+={json.dumps(probe)}",
    ]


# ddp_run's job on 2 processes, which the torchrun restart below runs again.
MODERN_MUON_JOB = [
    "--trainer.devices",
    "2",
    "--model.optimizer",
    "muon",
    "--trainer.gradient_clip_val",
    "1.0",
    *MODERN_FLAGS,
    "--model.embedding_learning_rate",
    "0.1",
    "--model.head_learning_rate",
    "0.004",
]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, shakespeare):
    """One launch under Lightning's DDP launcher (2 processes, 8 steps, logging every 4th), whose
    outputs the tests below read: every rank's windows, losses and weights, the barriers per
    step, and ``HarnessEval``'s scores on a local task. It trains the modern model (configs/modern-tiny-cpu.yaml's switches, value embeddings
    included) with Muon and the untied embedding's and head's own rates, as the torchrun restart
    does; GPT-2 under DDP: the torchrun two-node launch, tests/test_fsdp.py's DDP run and the
    README's ddp-2-cpu command."""
    tmp_path = tmp_path_factory.mktemp("ddp")
    small_text = tmp_path / "small.txt"
    small_text.write_text(shakespeare[:50_000])
    counter = {"class_path": "host_reads.BarrierCounter", "init_args": {"out": str(tmp_path / "barriers.json")}}
    harness = {
        "class_path": "gpt_lightning.HarnessEval",
        "init_args": {  # at steps 0 and 8
            "tasks": TASK,
            "every_n_steps": 8,
            "limit": 7,
            "include_path": str(write_task(tmp_path / "tasks", shakespeare)),
        },
    }
    args = fit_args(small_text, tmp_path, max_steps=8, log_every_n_steps=4)
    result = run_cli(
        *args,
        *MODERN_MUON_JOB,
        f"--trainer.callbacks+={json.dumps(counter)}",
        f"--trainer.callbacks+={json.dumps(harness)}",
        "--checkpoint.every_n_train_steps",
        "1000",
        cwd=tmp_path,
        env_extra=ENV,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return tmp_path, small_text, result


def test_ddp_on_two_cpu_processes(ddp_run):
    tmp_path, small_text, result = ddp_run
    # Each process trains (train tokens - 1) // (world x B x T) batches an epoch, and is told so.
    n = len(gpt2_encoding().encode_ordinary(small_text.read_text()))
    per_rank = (n - int(n * 0.1) - 1) // (2 * 2 * 32)
    assert f"1 epoch = {per_rank} batches per process" in result.stdout + result.stderr
    check_one_job_on_two_ranks(tmp_path, steps=8, logged_steps=[3, 7])


def test_muon_keeps_the_ranks_weights_identical(ddp_run):
    """Muon orthogonalizes the all-reduced gradients' momentum on each rank: the same update everywhere
    (and every weight of the modern model, value embeddings and gates included, gets a gradient: DDP
    would stop at an unused one)."""
    tmp_path, _, _ = ddp_run
    ranks = [json.loads((tmp_path / "ranks" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["optimizer"] for r in ranks] == ["MuonWithAdamW"] * 2
    assert ranks[0]["weights_checksum"] == ranks[1]["weights_checksum"]


def test_the_loss_is_averaged_over_ranks_only_when_it_is_written(ddp_run):
    """Lightning's sync_dist puts a barrier (host-blocking on NCCL) before each all-reduce: the loss
    is synchronized at logging steps only, and still logged as the mean over ranks there."""
    tmp_path, _, _ = ddp_run
    record = json.loads((tmp_path / "barriers.json").read_text())
    assert record["steps"] == 8
    barriers = {int(step) for step, count in record["barriers"].items() if count}
    assert barriers and barriers <= {3, 7}, record  # steps 3 and 7 end the logging intervals

    ranks = [json.loads((tmp_path / "ranks" / f"rank{r}.json").read_text()) for r in range(2)]
    (run_dir,) = (tmp_path / "tb" / "tiny-cpu").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    logged = {event.step: event.value for event in events.Scalars("train/loss")}
    assert sorted(logged) == [3, 7]
    for step, value in logged.items():
        assert value == pytest.approx((ranks[0]["losses"][step] + ranks[1]["losses"][step]) / 2, rel=1e-5)


def test_harness_tasks_on_two_ranks_give_the_one_process_result(ddp_run):
    """``HarnessEval`` splits the 7 examples over the 2 ranks (4 and 3, padded) and gathers them: the
    logged accuracies are those of one process scoring all 7 with the final weights."""
    from gpt_lightning.evaluation.harness_model import GPTHarnessLM
    from gpt_lightning.evaluation.tasks import run_tasks

    tmp_path, _, _ = ddp_run
    (run_dir,) = (tmp_path / "tb" / "tiny-cpu").iterdir()
    events = EventAccumulator(str(run_dir))
    events.Reload()
    logged = {
        tag: {e.step: e.value for e in events.Scalars(tag)}
        for tag in events.Tags()["scalars"]
        if tag.startswith("eval/")
    }
    assert logged[f"eval/{TASK}/samples"] == {0: 7, 8: 7}  # each example once, not once per rank
    one = run_tasks(
        GPTHarnessLM.from_checkpoint(run_dir / "checkpoints" / "last.ckpt"),
        [TASK],
        limit=7,
        include_path=tmp_path / "tasks",
        bootstrap_iters=0,
    )["results"][TASK]
    for metric in ("acc", "acc_norm"):
        assert logged[f"eval/{TASK}/{metric}"][8] == pytest.approx(one[f"{metric},none"], abs=1e-6)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_launched_by_torchrun(small_text, tmp_path):
    port = free_port()
    launches = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                str(port),
                "-m",
                "gpt_lightning",
                *fit_args(small_text, tmp_path),
                "--trainer.num_nodes",
                "2",
                "--trainer.devices",
                "1",
            ],
            cwd=tmp_path,
            env={**os.environ, **ENV},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [launch.communicate(timeout=300)[0] for launch in launches]
    for node, (launch, output) in enumerate(zip(launches, outputs)):
        assert launch.returncode == 0, f"node {node}:\n{output[-3000:]}"
    check_one_job_on_two_ranks(tmp_path, steps=6, logged_steps=list(range(6)))  # one TensorBoard run, by global rank 0


def test_torchrun_max_restarts_resumes_after_a_rank_dies(ddp_run, tmp_path):
    """``ddp_run``'s job under ``torchrun --max-restarts 1`` with ``--ckpt_path last``, rank 1 SIGKILLed
    after step 5 (an OOM kill, a lost node): the survivor stops without a traceback, torchrun relaunches both
    ranks, they resume from the newest last.ckpt (step 4) and end at the weights of ``ddp_run``, which
    was never interrupted. The launch is docs/resume.md's: ``--standalone`` with
    ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, a fresh store for each attempt."""
    whole, small_text, _ = ddp_run
    kill = {"class_path": "ddp_probe.KillRank", "init_args": {"rank": 1, "step": 5}}
    launch = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "-m",
            "gpt_lightning",
            *fit_args(small_text, tmp_path, max_steps=8, log_every_n_steps=4),
            *MODERN_MUON_JOB,
            "--checkpoint.every_n_train_steps",
            "2",
            "--ckpt_path",
            "last",
            f"--trainer.callbacks+={json.dumps(kill)}",
        ],
        cwd=tmp_path,
        env={**os.environ, **ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    log = launch.stdout + launch.stderr
    assert launch.returncode == 0, log[-3000:]
    # torchrun reports the killed rank and SIGTERMs the survivor. Whichever reaches the survivor first,
    # gloo's closed connection or that SIGTERM, it ends without a traceback on the console; if it was
    # the connection, in the dead-rank line, which names the file holding the whole error. When the
    # survivor has ended on that line before torchrun's monitor looks, torchrun names it (exit 1) first.
    killed_reported = "failed (exitcode: -9) local_rank: 1" in log
    survivor_reported = "failed (exitcode: 1) local_rank: 0" in log and "another rank of this run went away" in log
    assert (killed_reported or survivor_reported) and "Traceback" not in log, log[-3000:]
    if "gpt-lightning: error: another rank of this run went away" in log:  # not torchrun's SIGTERM first (143)
        assert "gpt-lightning: error: another rank of this run went away, and this one (rank 0 of 2) stopped" in log
        error_file = tmp_path / "tb" / "tiny-cpu" / "version_0" / "error-rank0.txt"
        assert f"the whole error is in {error_file})" in log and "Traceback" in error_file.read_text(), (
            error_file.read_text()
        )
    first, relaunched = [line for line in log.splitlines() if line.startswith("--ckpt_path last:")]
    assert "starting fresh" in first  # the job's first launch: no last.ckpt yet
    assert relaunched.endswith("tiny-cpu/version_0/checkpoints/last.ckpt"), relaunched
    weights = [torch.load(run / "ranks" / "rank0.pt", weights_only=True) for run in (whole, tmp_path)]
    assert weights[0].keys() == weights[1].keys()
    for key, value in weights[0].items():
        assert torch.equal(weights[1][key], value), key
