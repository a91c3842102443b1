"""The benchmark scripts run (tiny settings, no timing asserted: speed is judged by their reports).
generation.py and hellaswag.py run in benchmarks/gpu_run.sh's smoke mode, and test_gpu_run checks their reports."""

import json
import re
import subprocess
import sys
import time

import pytest
import torch
import yaml
from conftest import REPO


def run_script(name, *args, cwd):
    return subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / name), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )


def test_data_loading_benchmark_reports_a_multiple(cache_dir, tmp_path):
    result = run_script("data_loading.py", "--batches", "20", "--repeats", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "x faster" in result.stdout


def test_first_step_benchmark_splits_the_time_to_the_first_step(cache_dir, tmp_path):
    out = tmp_path / "first_step.json"
    result = run_script(
        "first_step.py",
        "--config",
        str(REPO / "configs/tiny-cpu.yaml"),
        "--variant",
        "eager=--model.compile false",
        "--trainer.max_steps",
        "3",
        "--trainer.val_check_interval",
        "2",
        "--trainer.limit_val_batches",
        "1",
        "--throughput.warmup_steps",
        "1",
        "--model.n_layer",
        "1",
        "--model.n_head",
        "2",
        "--model.n_embd",
        "32",
        "--data.block_size",
        "32",
        "--model.val_sample_tokens",
        "0",
        "--out",
        str(out),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    (run,) = json.loads(out.read_text())["runs"]["eager"]["cold"]
    # launch -> first step holds the sanity check; the first step and the rest follow it
    assert run["to_first_step_s"] > run["sanity_s"] > 0 and run["first_step_s"] > 0 and run["rest_s"] > 0
    assert run["total_s"] > run["to_first_step_s"] + run["first_step_s"] + run["rest_s"]
    assert run["validations"] == 1 and run["tokens_per_sec_median"] > 0
    assert (run["graphs_before_first_step"], run["graphs_in_first_step"], run["compile_notices"]) == (0, 0, 0)
    assert (
        run["module_file"] == "gpt_lightning/training/module.py"
    )  # this checkout ran, via the CLI (recorded relative to it)
    assert json.loads(out.read_text())["config"] == "configs/tiny-cpu.yaml"
    assert "eager (cold)" in result.stdout


def test_committed_results_name_no_directory_of_the_machine_that_made_them():
    # Paths into a checkout (configs/, gpt_lightning/, logs/ ...) are relative to the repository;
    # an absolute one may only name a scratch folder (a variant's source tree under /tmp).
    absolute = re.compile(r'"(?:[^"]*[=@])?(/(?!tmp/)[^"]*)"')
    files = sorted((REPO / "benchmarks" / "results").rglob("*.json"))
    assert len(files) >= 5
    for path in files:
        found = absolute.findall(path.read_text())
        assert not found, f"{path.relative_to(REPO)} records {found[:3]}"


def test_the_generation_table_in_the_results_readme_quotes_the_committed_results():
    text = (REPO / "benchmarks" / "results" / "cpu-2core" / "README.md").read_text()
    for name in (
        "generation-1thread.json",
        "generation-2thread.json",
        "generation-bf16-1thread.json",
        "generation-2thread-onednn.json",
    ):
        written = json.loads((REPO / "benchmarks" / "results" / "cpu-2core" / name).read_text())
        for batch, row in written["results"].items():
            ours, theirs = row["ours"], row["transformers"]
            quoted = (
                f"| {written['dtype']} | {written['threads']} | {batch} | {ours['tokens_per_sec']:.1f} ({ours['steps_per_sec_of_ceiling']:.0%}) | "
                f"{theirs['tokens_per_sec']:.1f} ({theirs['steps_per_sec_of_ceiling']:.0%}) | {row['ours_vs_transformers']:.2f}x |"
            )
            assert quoted in text, quoted


def test_the_lightning_cost_tables_in_the_results_readme_quote_the_committed_results():
    text = (REPO / "benchmarks" / "results" / "cpu-2core" / "README.md").read_text()
    for name, bar, run in (
        ("lightning_overhead.json", "plain `Trainer`'s", "5, plain `Trainer`'s bar (committed)"),
        ("lightning_overhead_step_bar.json", "`StepProgressBar`", "6, `StepProgressBar` (committed)"),
    ):
        results = json.loads((REPO / "benchmarks" / "results" / "cpu-2core" / name).read_text())["results"]
        eager, compiled = results["eager"], results["compiled"]
        quoted = (
            f"| {run} | {eager['ratio']:.3f} | {eager['ratio_per_round_median']:.3f} | "
            f"{compiled['ratio']:.3f} | {compiled['ratio_per_round_median']:.3f} |"
        )
        assert quoted in text, quoted
        for mode, r in results.items():
            host, by = r["host_ms_per_step"], r["host_ms_added_by_lightning_parts"]
            quoted = (
                f"| {mode}, {bar} | {host['plain']:.2f} | {host['plain_ours']:.2f} | {host['lightning']:.2f} | "
                f"{r['host_ms_added_by_lightning']:.2f}: {by['trainer_loop']:.2f}, {by['callbacks_and_logger']:.2f}, "
                f"{by['module_hooks']:.2f} | {r['host_added_fraction_of_plain_step']:.2%} |"
            )
            assert quoted in text, quoted
    # the figures quoted in the text: the ratios of total times, and the range of the host-time estimate
    committed = [
        json.loads((REPO / "benchmarks" / "results" / "cpu-2core" / name).read_text())["results"]
        for name in ("lightning_overhead.json", "lightning_overhead_step_bar.json")
    ]
    total = {
        mode: " and ".join(f"{r[mode]['ratio_total_time']:.3f}" for r in committed) for mode in ("eager", "compiled")
    }
    sentence = f"ratio of total times was {total['eager']} (eager), {total['compiled']}\n(compiled)"
    assert sentence in text, sentence
    estimates = [r[mode]["ratio_from_host_time"] for r in committed for mode in r]
    assert f"{min(estimates):.3f} to {max(estimates):.3f} in the four committed modes" in text


def test_the_architecture_tables_in_the_results_readme_quote_the_committed_results():
    text = (REPO / "benchmarks" / "results" / "cpu-2core" / "README.md").read_text()
    results = REPO / "benchmarks" / "results" / "cpu-2core"
    report = json.loads((results / "architectures.json").read_text())

    def ratio(x: float | None) -> str:
        return "not reached" if x is None else f"{x:.2f}x"

    for r in report["seeds"][0]["runs"]:
        quoted = (
            f"| {r['name']} | {r['final_val_loss']:.3f} | {ratio(r['tokens_ratio_to_best_gpt2_adamw'])} | "
            f"{ratio(r['tokens_ratio_to_best_gpt2_muon'])} | {r['step_time_vs_gpt2_muon_base']:.2f}x |"
        )
        assert quoted in text, quoted
    targets = report["headline"]["targets"]  # the verdict's figures, both seeds
    muon, adamw = (targets[f"modern_muon_to_best_gpt2_{k}"]["measured"] for k in ("muon", "adamw"))
    assert f"final loss in\n{muon[0]:.2f}x and {muon[1]:.2f}x of the tokens (target at most 0.8x)" in text
    assert f"AdamW run's in {adamw[0]:.2f}x and\n{adamw[1]:.2f}x (target at most 0.5x)" in text
    for r in json.loads((results / "architectures_step_time.json").read_text())["runs"]:
        quoted = (
            f"| {r['name']} | {r['eager_cpu_ms']:.0f} ({r['eager_cpu_vs_first']:.2f}x) | "
            f"{r['compiled_cpu_ms']:.0f} ({r['compiled_cpu_vs_first']:.2f}x) |"
        )
        assert quoted in text, quoted


def test_gpu_checks_measure_only_on_the_device_they_name():
    """gpu_checks.json once published CPU figures as the H200's (Lightning's teardown had moved the module
    back after fit): a GPU check refuses to start without CUDA, and a model left elsewhere stops the run."""
    import argparse

    import torch

    checks = load_benchmark("gpu_checks")
    assert checks.check_device(argparse.Namespace(accelerator="cpu")) == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            checks.check_device(argparse.Namespace(accelerator="cuda"))

    class Stuck(torch.nn.Linear):  # a module whose parameters stay where they are
        def to(self, *args, **kwargs):
            return self

    with pytest.raises(SystemExit, match=r"\['meta'\], not cpu"):
        checks.on_device(Stuck(2, 2, device="meta"), torch.device("cpu"))
    moved = checks.on_device(torch.nn.Linear(2, 2, dtype=torch.float64), torch.device("cpu"))
    assert moved.weight.device == torch.device("cpu")


def load_benchmark(name: str):
    """A benchmark script as a module, for its functions (main not run)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_decode_bound_counts_what_each_pass_must_read_and_compute():
    """generation.py's bound: per pass, the weights and the cached keys and values it reads, and the
    FLOPs torch's counter finds, which are the analytic count of a GPT-2 decode step; the time of
    each pass is the longer of the two at the machine's ceilings (a roofline)."""
    import torch

    from gpt_lightning.model import GPT, GPTConfig

    generation = load_benchmark("generation")
    config = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=32)
    batch, prompt, C = 3, 10, 32
    cost = generation.run_cost(config, batch, prompt, 5, torch.bfloat16)
    prefill, *steps = cost["passes"]
    assert len(steps) == 4  # the first of the 5 new tokens comes from the prefill
    assert cost["weight_bytes"] == 2 * (GPT(config).num_parameters() - 64 * C)  # bf16, the position table aside
    matmul_weights = config.n_layer * 12 * C * C + C * config.vocab_size  # qkv, proj, fc, fc proj; the tied head
    for i, step in enumerate(steps, 1):
        attended = prompt + i
        # 2 FLOPs a weight a row; q.k and attention.v over the attended positions in each layer
        assert step["flops"] == batch * (2 * matmul_weights + 4 * config.n_layer * C * attended)
        # the weights, a position's row, and keys and values of every layer at every attended position
        assert step["bytes"] == cost["weight_bytes"] + 2 * C + 2 * config.n_layer * batch * C * 2 * attended
    assert prefill["bytes"] == cost["weight_bytes"] + 2 * C * prompt
    assert prefill["flops"] > steps[0]["flops"]  # ten positions through the blocks, the head at the last
    bound = generation.roofline([{"flops": 10, "bytes": 1}, {"flops": 1, "bytes": 10}], 1.0, 2.0)
    assert bound["seconds"] == 10 + 5 and (bound["memory_bound_passes"], bound["compute_bound_passes"]) == (1, 1)


def test_the_evaluation_benchmark_sets_both_backends_against_the_bound_of_the_least_work():
    """evaluation.py, in this process on a one-layer GPT: beside each backend's requests/s, the bound
    (scoring_flops over the matmul FLOP/s measured in the run's dtype) and the fraction reached."""
    from gpt_lightning.model import GPTConfig

    evaluation = load_benchmark("evaluation")
    config, requests = GPTConfig(block_size=128, n_layer=1, n_head=2, n_embd=32), evaluation.hellaswag_shaped(1)
    result = evaluation.measure(config, "bfloat16", requests, batch_size=4, repeats=1)
    bound = result["bound"]
    assert bound["matmul_dtype"] == "bfloat16" and bound["matmul_flops_per_sec"] == max(bound["matmul_probes"]) > 0
    # the least work, by hand: the shared context once (causal: position i sees i + 1), each ending on top of
    # it, its tokens but the last through the blocks; 24 C^2 FLOPs a token a layer, 4 C a (token, position)
    # pair a layer, 2 C V a scored row
    (context,) = {tuple(c) for _, c, _ in requests}
    P, C, layers = len(context), config.n_embd, config.n_layer
    token, pair, head = layers * 24 * C * C, layers * 4 * C, 2 * C * config.vocab_size
    endings = [len(e) for _, _, e in requests]
    assert bound["flops"] == P * token + P * (P + 1) / 2 * pair + sum(
        (n - 1) * (token + P * pair) + (n - 1) * n / 2 * pair + n * head for n in endings
    )
    assert bound["flops"] == evaluation.scoring_flops(config, [(c, e) for _, c, e in requests])
    assert bound["requests_per_s"] == pytest.approx(4 * bound["matmul_flops_per_sec"] / bound["flops"])
    for name in ("hf", "ours"):
        assert result["fraction_of_bound"][name] == pytest.approx(
            result["requests_per_s"][name] / bound["requests_per_s"]
        )
        assert 0 < result["fraction_of_bound"][name] < 1
    row = evaluation.table({"tiny/bfloat16": result}).splitlines()[-1]
    assert f"| {bound['requests_per_s']:.2f} | {result['requests_per_s']['hf']:.2f} (" in row


def test_the_muon_variants_benchmark_adds_one_switch_at_a_time_and_reports_the_spread_over_seeds():
    """benchmarks/muon_variants.py (its CLI runs are the lead's to make): each run is plain Muon at the
    modern preset's rates plus one switch, and each run's tokens to the best AdamW run's final loss at the same seed, then the mean and spread."""
    import argparse

    bench = load_benchmark("muon_variants")
    shape = dict(steps=240, batch_size=16, block_size=64, eval_every=20)
    chosen = bench.runs(argparse.Namespace(adamw_lrs=[1.5e-3, 3e-3], runs=None, **shape))
    assert {config for config, _ in chosen.values()} == {"configs/tiny-cpu.yaml", "configs/modern-tiny-cpu.yaml"}
    assert {name: flags for name, (config, flags) in chosen.items() if "modern" in config} == {
        "modern preset": [],  # the preset as written
        "modern preset + ema": bench.EMA,
        "modern preset - sliding_window": ["--model.window_pattern", "L"],  # the preset's one measured gain, off
        **{f"modern preset + {s}": [f"--model.{s}", "true"] for s in bench.ARCH_SWITCHES},
    }
    assert bench.EMA == ["--trainer.callbacks+=EMAWeightAveraging", "--trainer.callbacks.decay", "0.95"]
    assert (
        bench.VAL_BATCHES
        == yaml.safe_load((REPO / "configs/tiny-cpu.yaml").read_text())["trainer"]["limit_val_batches"]
    )
    assert bench.ARCH_SWITCHES == ("residual_scalars",)
    base = chosen["muon"][1]
    assert base == ["--model.optimizer", "muon", "--model.muon_learning_rate", "0.02", "--model.learning_rate", "0.01"]
    assert {name: flags[len(base) :] for name, (_, flags) in chosen.items() if flags[: len(base)] == base} == {
        "muon": [],
        "muon + ema": bench.EMA,
        "muon + sliding_window": ["--model.window_pattern", "SSSL"],
        **{f"muon + {s}": [f"--model.{s}", "true"] for s in bench.ARCH_SWITCHES},
    }
    assert chosen["adamw lr=0.0015"] == ("configs/tiny-cpu.yaml", ["--model.learning_rate", "0.0015"])
    curves = {
        "adamw lr=0.0015": {0: [[100, 5.0], [200, 4.0]], 1: [[100, 5.0], [200, 4.4]]},
        "adamw lr=0.003": {0: [[100, 5.0], [200, 4.3]], 1: [[100, 5.0], [200, 4.2]]},
        "muon": {0: [[100, 3.9], [200, 3.0]], 1: [[100, 4.6], [200, 4.0]]},
        "faster": {0: [[100, 3.0], [200, 2.5]], 1: [[100, 4.4], [200, 3.6]]},
    }
    summary = bench.summarize(curves, budget=200)
    # the second target: tokens to GPT-2 + Muon's final at the seed, over the tokens Muon took to reach it
    assert summary["muon_final_val_loss"] == {0: 3.0, 1: 4.0}
    assert summary["runs"]["faster"]["tokens_ratio_to_muon"] == pytest.approx([0.5, 150 / 200])
    assert summary["runs"]["muon"]["tokens_ratio_to_muon_spread"]["mean"] == 1.0  # Muon's own final ends its budget
    assert summary["runs"]["adamw lr=0.003"]["reached_muon"] == "0/2"
    assert summary["best_adamw_final_val_loss"] == {0: 4.0, 1: 4.2}  # each seed's own best AdamW run
    muon = summary["runs"]["muon"]
    assert muon["tokens_ratio_to_best_adamw"] == pytest.approx(
        [0.5, (100 + 100 * 0.4 / 0.6) / 200]
    )  # at the first evaluation
    assert muon["tokens_ratio_spread"]["mean"] == pytest.approx((0.5 + 5 / 6) / 2)
    assert muon["final_val_loss_spread"] == pytest.approx({"mean": 3.5, "sd": 0.5**0.5, "min": 3.0, "max": 4.0})
    assert summary["runs"]["adamw lr=0.003"]["reached"] == "1/2"  # not at seed 0
    muon_row = "| muon | 3.500 ± 0.707 (3.000 to 4.000) | 0.67x ± 0.24 (0.50 to 0.83) | 2/2 | 1.00x ± 0.00 (1.00 to 1.00) | 2/2 |"
    assert muon_row in bench.table(summary).splitlines()
    assert "| adamw lr=0.003 |" in bench.table(summary) and "| not reached | 0/2 |" in bench.table(summary)
    with pytest.raises(SystemExit, match=r"run 'faster' has no curve at seeds \[1\]"):
        bench.summarize({**curves, "faster": {0: curves["faster"][0]}}, budget=200)


def test_muon_variants_reuses_the_curves_of_the_configs_as_they_are_and_no_others(tmp_path, monkeypatch):
    """The committed curves are those of the configs as they are: reused whole, they give the committed
    table without a fit. A file from other configs (a run name meant another model: the preset before
    its windows) is refused, not silently reused."""
    bench = load_benchmark("muon_variants")
    committed = REPO / "benchmarks" / "results" / "cpu-2core" / "muon_variants.json"
    runs = ["adamw lr=0.0015", "muon", "modern preset", "modern preset - sliding_window"]

    def run(reuse) -> None:
        argv = ["muon_variants.py", "--adamw_lrs", "1.5e-3", "--runs", *runs, "--reuse", str(reuse)]
        monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path / "out")])
        bench.main()

    run(committed)  # every curve there: nothing trains
    rows = (tmp_path / "out" / "muon_variants.md").read_text().splitlines()[2:]
    assert len(rows) == len(runs) and all(row in committed.with_suffix(".md").read_text() for row in rows)
    stale = json.loads(committed.read_text())
    stale["config_sha256"]["configs/modern-tiny-cpu.yaml"] = "0" * 64
    (tmp_path / "stale.json").write_text(json.dumps(stale))
    with pytest.raises(SystemExit, match="other contents of configs/tiny-cpu.yaml or configs/modern-tiny-cpu.yaml"):
        run(tmp_path / "stale.json")


def test_the_per_token_tables_in_the_results_readme_quote_the_committed_results():
    """The results README's tables of the newer steps are benchmarks/muon_variants.py's committed tables, row for
    row, at both shapes (and the EMA's and the short budgets' runs on another machine)."""
    text = (REPO / "benchmarks" / "results" / "cpu-2core" / "README.md").read_text()
    for shape in (
        "cpu-2core",
        "cpu-2core-6x192",
        "cpu-2core-intel-amx",
        "cpu-2core-intel-amx/budget-108",
        "cpu-2core-intel-amx/budget-144",
    ):
        rows = (REPO / "benchmarks" / "results" / shape / "muon_variants.md").read_text().splitlines()
        assert len(rows) > 2 and all(row in text for row in rows), shape


def test_muon_variants_measures_shorter_runs_against_an_earlier_result_s_targets(tmp_path, monkeypatch):
    """``--targets``: runs of fewer steps, each with its own schedule, against the final losses of the
    240-step runs at each seed, in fractions of those runs' budget: the committed short-budget tables
    come back from their curves without a fit, and targets from another batch shape are refused."""
    bench = load_benchmark("muon_variants")
    targets = REPO / "benchmarks" / "results" / "cpu-2core" / "muon_variants.json"
    committed = REPO / "benchmarks" / "results" / "cpu-2core-intel-amx" / "budget-108" / "muon_variants.json"

    def run(targets_file, *more) -> None:
        argv = ["muon_variants.py", "--steps", "108", "--eval_every", "27", "--runs", "modern preset"]
        argv += ["--targets", str(targets_file), "--reuse", str(committed), *more]
        monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path / "out")])
        bench.main()

    run(targets)  # no AdamW run needed: the targets are the earlier result's
    assert (tmp_path / "out" / "muon_variants.md").read_text() == committed.with_suffix(".md").read_text()
    saved = json.loads((tmp_path / "out" / "muon_variants.json").read_text())
    earlier = json.loads(targets.read_text())
    assert saved["muon_final_val_loss"] == earlier["muon_final_val_loss"]  # the 240-step runs' finals
    assert saved["runs"]["modern preset"]["reached_muon"] == "0/3"
    other = {**earlier, "shape": {**earlier["shape"], "batch_size": 8}}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(SystemExit, match="another model, batch or configs"):
        run(tmp_path / "other.json")
    (tmp_path / "no_muon.json").write_text(json.dumps({**earlier, "muon_final_val_loss": None}))
    with pytest.raises(SystemExit, match="no Muon run"):
        run(tmp_path / "no_muon.json")
    fewer = {**earlier, "best_adamw_final_val_loss": {"0": earlier["best_adamw_final_val_loss"]["0"]}}
    (tmp_path / "fewer.json").write_text(json.dumps(fewer))
    with pytest.raises(SystemExit, match=r"no targets at seeds \[1, 2\]"):
        run(tmp_path / "fewer.json")


def test_the_read_bandwidth_is_measured_quickly_and_plausibly():
    start = time.perf_counter()
    bandwidth = load_benchmark("generation").read_bytes_per_sec("cpu", torch.float32, nbytes=2**20, repeats=2)
    assert time.perf_counter() - start < 2
    assert 1e8 < bandwidth < 1e13  # 1 MB sits in a cache: faster than memory, but not beyond reason
