"""Tokens to a given loss through the CLI: GPT-2 with AdamW, with Muon, and with each of issue 53's
switches alone (docs/modern.md), over several seeds.

Every run is ``gpt-lightning fit`` in a process of its own, as a user runs it: configs/tiny-cpu.yaml's
model (4 layers x 128, GPT-2's architecture and vocabulary), B=16, T=64, 240 steps, windows shuffled,
float32, eager, WSD (decay over the last 30%, to 0), betas (0.9, 0.95), no AdamW weight decay (the
settings configs/modern-tiny-cpu.yaml trains with), the CLI's validation (the config's 4 batches)
every ``--eval_every`` steps. At each seed ``--seed_everything N --data.seed N``: other initial
weights and other windows. The runs (``RUNS``):

- GPT-2 + AdamW at each of ``--adamw_lrs`` (1.5e-3, 3e-3): the best one at a seed is its target;
- GPT-2 + Muon at configs/modern-tiny-cpu.yaml's rates (Muon 0.02, the AdamW part 0.01), switches off;
- configs/modern-tiny-cpu.yaml as written (its switches and rates) at the same shape;
- plain Muon and the preset, each with a weight EMA (``EMA``: Lightning's ``EMAWeightAveraging`` at
  decay 0.95, docs/optimizers.md): validated, so compared, from the averaged weights;
- GPT-2 + Muon with nanochat's sliding-window attention (``--model.window_pattern SSSL``, docs/modern.md:
  blocks 0 to 2 see 16 positions back at T=64, a quarter, block 3 all of them), and the preset without
  them (``--model.window_pattern L``: the preset's windows are the one switch it gained by this measure);
- the switch between the blocks (``ARCH_SWITCHES``: nanochat's residual scalars; docs/modern.md; the smear
  and the U-net skips were measured so and removed), alone on GPT-2 + Muon ("muon + <switch>") and on the
  preset ("modern preset + <switch>"): whether it enters the preset.

For each run, over the seeds: the final validation loss and the tokens it needed to reach the best
AdamW run's final validation loss at the same seed (interpolated between evaluations, as a fraction
of the budget), each as its mean and spread (sample standard deviation, min and max). Writes
``muon_variants.json`` (every curve) and ``muon_variants.md`` (the table) to ``--out``.

    OMP_NUM_THREADS=1 python benchmarks/muon_variants.py --jobs 2 --out benchmarks/results/cpu-2core

``--fit_args`` adds options to every run (e.g. ``"--trainer.accelerator cuda"``), ``--runs`` picks runs,
``--reuse`` takes the curves of an earlier ``muon_variants.json`` at the same shape instead of training them again;
each curve is kept in ``muon_variants.partial.json`` as it finishes, so a stopped measurement goes on
with ``--reuse`` of that file. ``--targets`` measures runs of fewer ``--steps`` (each its own schedule,
its decay within it) against an earlier result's targets and budget: whether a shorter run gets there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from gpt_lightning.atomic import atomic_write_bytes

REPO = Path(__file__).resolve().parents[1]
TINY, PRESET = "configs/tiny-cpu.yaml", "configs/modern-tiny-cpu.yaml"
MUON = yaml.safe_load((REPO / PRESET).read_text())["model"]  # its Muon and AdamW-part rates
MUON_BASE = ["--model.optimizer", "muon", "--model.muon_learning_rate", str(MUON["muon_learning_rate"])]
MUON_BASE += ["--model.learning_rate", str(MUON["learning_rate"])]
# Lightning's weight EMA, as a user adds it. Decay 0.95: a horizon of 1 / (1 - 0.95) = 20 steps, 1/12 of the
# 240-step run; modded-nanogpt's Tail-EMA (track 3, records #45-46) averages over 150 steps of 2,720 (1/18),
# the schedule's own timescale at its end. Updated from the first step, so every validation reads an average.
EMA = ["--trainer.callbacks+=EMAWeightAveraging", "--trainer.callbacks.decay", "0.95"]
VAL_BATCHES = 4  # configs/tiny-cpu.yaml's trainer.limit_val_batches: validation batches of every other run


# The model's switch between the blocks, off in both configs: a run adds it.
ARCH_SWITCHES = ("residual_scalars",)


def runs(args: argparse.Namespace) -> dict[str, tuple[str, list[str]]]:
    """Each run's name, its config and the ``fit`` options that make it what it is."""
    gpt2 = {
        **{f"adamw lr={lr:g}": ["--model.learning_rate", str(lr)] for lr in args.adamw_lrs},
        "muon": MUON_BASE,
        "muon + ema": [*MUON_BASE, *EMA],
        "muon + sliding_window": [*MUON_BASE, "--model.window_pattern", "SSSL"],  # nanochat's pattern
        **{f"muon + {switch}": [*MUON_BASE, f"--model.{switch}", "true"] for switch in ARCH_SWITCHES},
    }
    modern = {  # the preset as written (its switches and rates), at this shape
        "modern preset": [],
        "modern preset + ema": EMA,
        "modern preset - sliding_window": ["--model.window_pattern", "L"],
        **{f"modern preset + {switch}": [f"--model.{switch}", "true"] for switch in ARCH_SWITCHES},
    }
    every = {
        **{name: (TINY, flags) for name, flags in gpt2.items()},
        **{name: (PRESET, flags) for name, flags in modern.items()},
    }
    return {name: run for name, run in every.items() if args.runs is None or name in args.runs}


def fit_options(args: argparse.Namespace, seed: int, config: str = TINY) -> list[str]:
    """What every run of ``seed`` shares, over ``config``."""
    shared = {
        "trainer.max_steps": args.steps,
        "trainer.val_check_interval": args.eval_every,
        "trainer.precision": "32-true",
        "trainer.enable_progress_bar": "false",
        "data.batch_size": args.batch_size,
        "data.block_size": args.block_size,
        "data.shuffle": "true",
        "data.seed": seed,
        "model.compile": "false",
        "model.val_sample_tokens": 0,
        "model.betas": "[0.9,0.95]",
        "model.weight_decay": MUON["weight_decay"],
        "model.lr_schedule": MUON["lr_schedule"],
        "model.decay_fraction": MUON["decay_fraction"],
        "model.min_lr_ratio": MUON["min_lr_ratio"],
    }
    options = ["--config", str(REPO / config), "--seed_everything", str(seed)]
    return options + [word for key, value in shared.items() for word in (f"--{key}", str(value))]


def train(args: argparse.Namespace, run: tuple[str, list[str]], seed: int) -> list[list[float]]:
    """One ``gpt-lightning fit``; its validation curve, [tokens, val/loss] at each evaluation."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with tempfile.TemporaryDirectory() as scratch:  # its checkpoints, and the logs read here
        config, flags = run
        command = [sys.executable, "-m", "gpt_lightning", "fit", *fit_options(args, seed, config), *flags]
        command += [*shlex.split(args.fit_args), "--trainer.logger.init_args.save_dir", scratch]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
        child = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True)
        if child.returncode != 0:
            raise SystemExit(
                f"run failed (exit code {child.returncode}): {shlex.join(command)}\n{child.stderr[-4000:]}"
            )
        (run_dir,) = Path(scratch).glob("*/version_0")
        events = EventAccumulator(str(run_dir))
        events.Reload()
        tokens_per_step = args.batch_size * args.block_size
        return [[e.step * tokens_per_step, e.value] for e in events.Scalars("val/loss")]


def tokens_to_reach(curve: list[list[float]], target: float) -> float | None:
    """The tokens at which ``curve`` first reaches ``target``, interpolated linearly between evaluations."""
    if curve and curve[0][1] <= target:  # at the first evaluation
        return curve[0][0]
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def spread(values: list[float]) -> dict:
    """Mean, sample standard deviation (None for one value), min and max."""
    sd = statistics.stdev(values) if len(values) > 1 else None
    return {"mean": statistics.fmean(values), "sd": sd, "min": min(values), "max": max(values)}


def summarize(curves: dict[str, dict[int, list]], budget: int, earlier: dict | None = None) -> dict:
    """Per seed, the best AdamW run's final loss (the target); per run, over the seeds, its final loss
    and its tokens to that target (a fraction of ``budget``; None at a seed where it is not reached).
    With a "muon" run, also each run's tokens to GPT-2 + Muon's final loss at the seed, a fraction of
    ``budget`` too (the tokens Muon itself trained to reach it): the issue's second target. ``earlier``
    (``--targets``): both targets and the budget are that result's, at its own number of steps."""
    seeds = sorted({seed for by_seed in curves.values() for seed in by_seed})
    for name, by_seed in curves.items():
        if missing := sorted(set(seeds) - set(by_seed)):
            raise SystemExit(f"run {name!r} has no curve at seeds {missing}: train it there or --reuse a file that has")
    if earlier is not None:
        if missing := [seed for seed in seeds if str(seed) not in earlier["best_adamw_final_val_loss"]]:
            raise SystemExit(f"--targets: the earlier result has no targets at seeds {missing}")
        targets = {seed: earlier["best_adamw_final_val_loss"][str(seed)] for seed in seeds}
        muon_targets = {seed: earlier["muon_final_val_loss"][str(seed)] for seed in seeds}
        shape = earlier["shape"]
        budget = shape["steps"] * shape["batch_size"] * shape["block_size"]
    else:
        adamw = [name for name in curves if name.startswith("adamw")]
        targets = {seed: min(curves[name][seed][-1][1] for name in adamw) for seed in seeds}
        muon_targets = {seed: curves["muon"][seed][-1][1] for seed in seeds} if "muon" in curves else None

    def to(by_seed: dict[int, list], target: dict[int, float]) -> tuple[list, dict | None, str]:
        reached = [tokens_to_reach(by_seed[seed], target[seed]) for seed in seeds]
        ratios = [None if r is None else r / budget for r in reached]
        got = [r for r in ratios if r is not None]
        return ratios, spread(got) if got else None, f"{len(got)}/{len(seeds)}"

    rows = {}
    for name, by_seed in curves.items():
        final = [by_seed[seed][-1][1] for seed in seeds]
        ratios, ratio_spread, reached = to(by_seed, targets)
        rows[name] = {
            "final_val_loss": final,
            "final_val_loss_spread": spread(final),
            "tokens_ratio_to_best_adamw": ratios,
            "tokens_ratio_spread": ratio_spread,
            "reached": reached,
        }
        if muon_targets:
            keys = ("tokens_ratio_to_muon", "tokens_ratio_to_muon_spread", "reached_muon")
            rows[name].update(zip(keys, to(by_seed, muon_targets)))
    return {"seeds": seeds, "best_adamw_final_val_loss": targets, "muon_final_val_loss": muon_targets, "runs": rows}


def table(summary: dict) -> str:
    """The markdown table of ``summarize``'s runs."""

    def shown(s: dict | None, digits: int, unit: str = "") -> str:
        if s is None:
            return "not reached"
        sd = "" if s["sd"] is None else f" ± {s['sd']:.{digits}f}"
        return f"{s['mean']:.{digits}f}{unit}{sd} ({s['min']:.{digits}f} to {s['max']:.{digits}f})"

    muon = summary.get("muon_final_val_loss") is not None
    lines = [
        "| run | final val loss, mean ± sd (min to max) | tokens to the best AdamW's final, mean ± sd (min to max) | reached |"
        + (" tokens to GPT-2 + Muon's final, mean ± sd (min to max) | reached |" if muon else ""),
        "|---|---|---|---|" + ("---|---|" if muon else ""),
    ]
    for name, row in summary["runs"].items():
        lines.append(
            f"| {name} | {shown(row['final_val_loss_spread'], 3)} | "
            f"{shown(row['tokens_ratio_spread'], 2, 'x')} | {row['reached']} |"
            + (f" {shown(row['tokens_ratio_to_muon_spread'], 2, 'x')} | {row['reached_muon']} |" if muon else "")
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu-2core"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--block_size", type=int, default=64)
    parser.add_argument("--eval_every", type=int, default=20)
    parser.add_argument("--adamw_lrs", type=float, nargs="+", default=[1.5e-3, 3e-3])
    parser.add_argument("--runs", nargs="+", default=None, help="run only these (names as in the table)")
    parser.add_argument(
        "--reuse",
        type=Path,
        nargs="*",
        default=[],
        help="earlier muon_variants.json files: their runs are not trained again",
    )
    parser.add_argument("--jobs", type=int, default=1, help="fits run at once (give each OMP_NUM_THREADS=1)")
    parser.add_argument("--fit_args", default="", help="more gpt-lightning fit options for every run, shell-quoted")
    parser.add_argument(
        "--targets",
        type=Path,
        help="an earlier muon_variants.json with AdamW and Muon runs: its final losses are the targets and "
        "its budget the unit, so runs of fewer --steps (each with its own schedule) show whether they reach them",
    )
    args = parser.parse_args()
    chosen = runs(args)
    earlier_targets = json.loads(args.targets.read_text()) if args.targets else None
    if earlier_targets is None and not any(name.startswith("adamw") for name in chosen):
        raise SystemExit("--runs: include an AdamW run, the target of the others (or give --targets)")
    curves: dict[str, dict[int, list]] = {name: {} for name in chosen}
    # --fit_args too: a larger model (--model.n_layer ...) is another shape
    shape = {k: getattr(args, k) for k in ("steps", "batch_size", "block_size", "eval_every", "fit_args")}
    # the configs' contents too: a run's name means what the configs say (the preset gained its windows)
    configs = {path: hashlib.sha256((REPO / path).read_bytes()).hexdigest() for path in (TINY, PRESET)}
    if earlier_targets is not None:
        same = ("batch_size", "block_size", "fit_args")
        if any(earlier_targets["shape"].get(k, "") != shape[k] for k in same) or (
            earlier_targets.get("config_sha256") != configs
        ):
            raise SystemExit(f"--targets {args.targets}: another model, batch or configs than this run's")
        if not earlier_targets.get("muon_final_val_loss"):
            raise SystemExit(f"--targets {args.targets}: it has no Muon run, whose final loss is a target")
    for path in args.reuse:  # curves trained before at this shape: not trained again
        earlier = json.loads(path.read_text())
        if {k: earlier["shape"].get(k, "") for k in shape} != shape:
            raise SystemExit(f"--reuse {path}: another shape ({earlier['shape']}) than this run's ({shape})")
        if earlier.get("config_sha256") != configs:
            raise SystemExit(
                f"--reuse {path}: written with other contents of {TINY} or {PRESET} (or before they were "
                "recorded): its curves may be of runs that now mean something else; train them again"
            )
        for name, by_seed in earlier["curves"].items():
            for seed, curve in by_seed.items():
                if name in curves and int(seed) in args.seeds:
                    curves[name][int(seed)] = curve

    finished = threading.Lock()

    def run(seed: int, name: str) -> None:
        curve = train(args, chosen[name], seed)
        with finished:  # every finished curve kept at once: a stopped measurement goes on with --reuse
            curves[name][seed] = curve
            args.out.mkdir(parents=True, exist_ok=True)
            partial = {"shape": {**shape, "seeds": args.seeds}, "config_sha256": configs, "curves": curves}
            partial = json.dumps(partial) + "\n"
            atomic_write_bytes(args.out / "muon_variants.partial.json", partial.encode())
        print(f"seed {seed} {name}: final val loss {curve[-1][1]:.4f}", flush=True)

    # Losses do not depend on timing: --jobs fits side by side (each with OMP_NUM_THREADS threads) give the same curves.
    with ThreadPoolExecutor(args.jobs) as pool:
        todo = [(seed, name) for seed in args.seeds for name in chosen if seed not in curves[name]]
        for done in [pool.submit(run, seed, name) for seed, name in todo]:
            done.result()
    summary = summarize(curves, args.steps * args.batch_size * args.block_size, earlier_targets)
    report = {
        "what": "validation loss against tokens through gpt-lightning fit: AdamW, Muon, Muon's newer steps "
        "one at a time (benchmarks/muon_variants.py)",
        "shape": {**shape, "seeds": args.seeds},
        "config_sha256": configs,
        "targets_from": str(args.targets) if args.targets else None,
        "fit_options_first_seed": [
            word.replace(f"{REPO}{os.sep}", "")
            for word in fit_options(args, args.seeds[0]) + shlex.split(args.fit_args)
        ],
        "run_options": chosen,
        "loadavg": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None,
        **summary,
        "curves": curves,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "muon_variants.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "muon_variants.md").write_text(table(summary))
    print(table(summary))


if __name__ == "__main__":
    main()
