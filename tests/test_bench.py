"""`gpt-lightning bench` on a very small CPU config: eager and regional compilation side by side (the
scopes themselves are checked in test_compile); table, JSON, PNG, and the divergence exit. Here the runs
train in the pytest process, on the suite's one tiny compiled shape, so the compile cache is shared (so do
the README walkthrough's); the GPU run's smoke mode launches real child processes, and what --cold gives a
child is checked on its own below."""

import json
from pathlib import Path

import pytest
import torch
from conftest import REPO, tiny_flags
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from gpt_lightning.cli import main
from gpt_lightning.commands.bench import repo_relative, repository_root


def test_bench_compares_runs_side_by_side_and_fails_on_divergence(tmp_path, monkeypatch, capfd):
    from gpt_lightning.commands import bench

    def in_this_process(name, args, cold):  # run_in_subprocess's result, without a process launch
        torch._dynamo.reset()  # as in a new process: nothing compiled yet, so the run pays its compile
        return {"name": name, "args": args, **bench.train_one(args)}

    monkeypatch.setattr(bench, "run_in_subprocess", in_this_process)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "bench",
                "--config",
                str(REPO / "configs/tiny-cpu.yaml"),
                "--runs",
                "eager",
                "blocks",
                "--every",
                "2",
                "--tolerance",
                "-1",  # any difference at all counts as divergence: the failure path
                *tiny_flags(
                    {
                        "model.compile": None,
                        "model.val_sample_tokens": None,
                        "model.n_layer": 2,
                        "data.block_size": 32,
                        "trainer.max_steps": 6,
                        "throughput.warmup_steps": 2,
                        "trainer.val_check_interval": 3,
                        "trainer.accumulate_grad_batches": 2,
                        "trainer.log_every_n_steps": 1,  # as the GPU recipes do
                        "trainer.limit_val_batches": 1,
                        "trainer.logger.init_args.save_dir": tmp_path / "tb",
                    }
                ),
            ]
        )
    out, err = capfd.readouterr()
    assert exit_info.value.code == 1, err[-3000:]
    assert "FAIL: blocks's loss curve leaves eager's" in out
    (run_dir,) = (tmp_path / "tb" / "bench").iterdir()
    assert {p.name for p in run_dir.iterdir()} >= {"eager", "blocks", "bench.json", "bench.png"}
    saved = json.loads((run_dir / "bench.json").read_text())
    assert saved["cold_compile_cache"] is False
    # Paths in this checkout are recorded relative to it; the test's own folder (outside it) as given.
    assert saved["config"] == "configs/tiny-cpu.yaml" == saved["runs"]["eager"]["args"][1]
    assert str(REPO) not in json.dumps(saved)
    assert saved["runs"]["eager"]["log_dir"] == str(run_dir / "eager")
    runs, summary = saved["runs"], saved["summary"]
    # One loss per optimizer step, each train/loss's value: the mean of its 2 micro-batches (it kept each
    # micro-batch's, already halved by Lightning: 12 losses of about 5.4, then an IndexError before bench.json).
    assert [len(runs[name][key]) for name in ("eager", "blocks") for key in ("loss", "step_ms")] == [6] * 4
    assert runs["eager"]["loss"][0] > 10  # about ln(50257) = 10.8 for an untrained model
    for name in ("eager", "blocks"):
        events = EventAccumulator(str(run_dir / name))
        events.Reload()
        assert runs[name]["loss"] == pytest.approx([e.value for e in events.Scalars("train/loss")], rel=1e-6)
    assert (runs["eager"]["compiled"], runs["blocks"]["compiled"], runs["blocks"]["compile_scope"]) == (
        False,
        True,
        "blocks",
    )
    for name in ("blocks",):
        # what bench reports, not how fast this machine was: in a suite worker whose earlier tests
        # compiled this shape, the "compile" is a cache hit, and a loaded machine's steps vary more
        row = summary[name]
        assert row["speedup_vs_eager"] > 0 and row["first_step_s"] > 0
        assert row["compile_time_s"] == pytest.approx(row["first_step_s"] - row["step_ms_median"] / 1000)
        assert summary[name]["max_loss_diff_vs_eager"] < 0.5  # same seed, same batches: the curves stay close
    assert summary["eager"]["speedup_vs_eager"] is None
    for name in ("eager", "blocks"):
        # Beside each run's tokens/s, the bound this machine sets: its training FLOPs per token over the
        # matmul FLOP/s measured in the run's process, in the run's dtype; and the fraction reached.
        bound, run = runs[name]["bound"], runs[name]["summary"]
        assert bound["matmul_dtype"] == {"bf16-mixed": "bfloat16", "32-true": "float32"}[run["precision"]]
        assert bound["flops_per_token"] == run["flops_per_token"] > 0
        assert bound["tokens_per_sec"] == pytest.approx(bound["matmul_flops_per_sec"] / run["flops_per_token"])
        assert summary[name]["bound_tokens_per_sec"] == bound["tokens_per_sec"]
        assert 0 < summary[name]["fraction_of_bound"] < 1  # no run passes the machine's matmul peak
        assert summary[name]["fraction_of_bound"] == pytest.approx(
            run["tokens_per_sec_median"] / bound["tokens_per_sec"]
        )
        assert f"{summary[name]['fraction_of_bound']:.1%}" in out.split("bound tok/s")[1]
    assert f"{bound['matmul_dtype']} " in out.split("bound tok/s: training FLOPs per token")[1]
    assert (run_dir / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_repo_relative_rewrites_paths_in_the_checkout_only():
    assert repository_root() == REPO  # an editable install: the clone holding pyproject.toml
    root = Path("/work/repo")
    given = {
        "config": "/work/repo/configs/a.yaml",
        "args": [
            "--config",
            "/work/repo/configs/a.yaml",
            "--trainer.callbacks+=/work/repo/x.py",
            "--data.data_path=/work/repo/data/t.txt",
            3,
            None,
        ],
        "root": "/work/repo",
        "outside": "/tmp/work/repo/configs/a.yaml",
        "sibling": "/work/repo2/configs/a.yaml",
        "log_dir": "logs/bench/x/eager",
    }
    assert repo_relative(given, root) == {
        "config": "configs/a.yaml",
        "args": ["--config", "configs/a.yaml", "--trainer.callbacks+=x.py", "--data.data_path=data/t.txt", 3, None],
        "root": ".",
        "outside": "/tmp/work/repo/configs/a.yaml",
        "sibling": "/work/repo2/configs/a.yaml",
        "log_dir": "logs/bench/x/eager",
    }


@pytest.mark.parametrize("cold", [True, False])
def test_cold_gives_each_run_its_own_empty_compile_cache(cold, tmp_path, monkeypatch, capsys):
    """What --cold changes for a run's process: its inductor and Triton caches start empty, one pair
    per run, and go when the run ends, what it compiled merged into the caches the user's shell names
    (the GPU run's later steps start warm); without it the run uses those caches."""
    from gpt_lightning.commands import bench

    warm = tmp_path / "cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(warm))
    seen = []

    def child(command, env):  # stands in for the child process: records what it was given
        result = Path(command[command.index("--child") + 1])
        cache = Path(env["TORCHINDUCTOR_CACHE_DIR"])
        seen.append(
            {key: env.get(key) for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
            | {"empty": not cache.exists() or not any(cache.iterdir()), "scratch": str(result.parent)}
        )
        (cache / "fxgraph").mkdir(parents=True, exist_ok=True)
        (cache / "fxgraph" / f"{len(seen)}.bin").write_text("compiled")  # what this run compiled
        result.write_text(json.dumps({"loss": []}))
        return bench.subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(bench.subprocess, "run", child)
    for name in ("eager", "blocks"):
        assert bench.run_in_subprocess(name, ["--config", "c.yaml"], cold)["name"] == name
    assert ("(cold compile cache)" in capsys.readouterr().out) is cold
    if cold:
        first, second = seen
        for run in seen:
            assert run["TORCHINDUCTOR_CACHE_DIR"] == str(Path(run["scratch"]) / "inductor") and run["empty"]
            assert run["TRITON_CACHE_DIR"] == str(Path(run["scratch"]) / "triton")
            assert not Path(run["scratch"]).exists()  # removed with the run
        assert first["scratch"] != second["scratch"]
    else:
        assert [run["TORCHINDUCTOR_CACHE_DIR"] for run in seen] == [str(warm)] * 2
    assert sorted(p.name for p in (warm / "fxgraph").iterdir()) == ["1.bin", "2.bin"]  # both runs' graphs, warm


def test_bench_writes_its_results_after_each_run_into_out(tmp_path, monkeypatch):
    """A run that fails (or a GPU run's time limit that kills bench) keeps the runs before it: bench.json
    and bench.png are written after each run, into --out (it wrote them once, after the last run)."""
    from gpt_lightning.commands import bench
    from gpt_lightning.errors import UserError

    def fake_run(name, args, cold):  # run_in_subprocess: eager trains, the compiled run dies
        if name == "blocks":
            raise UserError("bench run 'blocks' failed (exit code 137)")
        return {
            "name": name,
            "args": args,
            "log_dir": str(tmp_path / "tb" / name),
            "compiled": False,
            "compile_scope": "blocks",
            "loss": [10.9, 10.1],
            "step_ms": [9.0, 8.0],
            "tokens_per_sec": [100.0, 110.0],
            "summary": None,
        }

    monkeypatch.setattr(bench, "run_in_subprocess", fake_run)
    with pytest.raises(SystemExit):  # the CLI's one-line refusal of the UserError
        main(
            ["bench", "--config", "configs/tiny-cpu.yaml", "--runs", "eager", "blocks", "--out", str(tmp_path / "out")]
        )
    saved = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert list(saved["runs"]) == ["eager"] and saved["runs"]["eager"]["loss"] == [10.9, 10.1]
    assert (tmp_path / "out" / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_the_verdict_compares_mean_losses_so_bf16_step_noise_is_not_a_divergence():
    """Two bf16 runs of one config (eager, compiled) part by single-step noise that grows along the
    run: on configs/tiny-cpu.yaml single steps differed by 0.22 to 0.33 in three runs (a FAIL at the
    old per-step tolerance 0.25 in two of them), 10-step means by 0.09 and 0.25 in the two measured
    here (docs/benchmarks.md). Here: steps that differ by up to 0.35 either way around the same
    curve pass; a curve 0.8 above from step 100 on fails."""
    from gpt_lightning.commands.bench import compare

    generator = torch.Generator().manual_seed(0)
    curve = [6.0 + 4.0 * 0.97**step for step in range(200)]
    noise = (torch.rand(200, generator=generator) - 0.5) * 0.7 * torch.linspace(0, 1, 200)  # grows along the run
    eager = {"loss": curve, "summary": None, "compiled": False}
    noisy = {"loss": [c + float(n) for c, n in zip(curve, noise)], "summary": None, "compiled": True}
    row = compare(noisy, eager)
    assert row["max_step_loss_diff_vs_eager"] > 0.25  # what the old verdict read as leaving eager's curve
    assert row["max_loss_diff_vs_eager"] < 0.12
    leaving = {
        "loss": [c + (0.8 if step >= 100 else 0.0) for step, c in enumerate(noisy["loss"])],
        "summary": None,
        "compiled": True,
    }
    row = compare(leaving, eager)
    assert row["max_loss_diff_vs_eager"] > 0.5 and 100 <= row["max_loss_diff_step"] < 200
