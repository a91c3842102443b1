"""Time to the first training step from an empty compile cache: what a first-time user waits.

Each run launches ``gpt-lightning fit --config CONFIG ...`` as a user does, in its own process, with
fresh ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` (cold); with ``--warm [NAME ...]`` each
variant (or those named) then runs again on the cache its cold run filled. A ``Timeline`` callback, added through
``--trainer.callbacks+=``, stamps the wall clock at Lightning's hooks and reads Dynamo's count of
compiled graphs there. Variants alternate within each round (a, b, c, a, b, c, ...) so that drift on
a shared machine hits them all; each figure is the median over rounds.

Per variant:
  to first step  launch -> the first training step starts (imports, data, model, summary, sanity check)
  sanity         the sanity check alone
  first step     the first training step (with a cold cache: the training graph's compilation)
  rest           from the end of the first step to the end of fit (steps, validations, checkpoints)
  validation     the validations after the sanity check, summed
  total          launch -> the process exits
  graphs         graphs Dynamo compiled before the first step / in it / after it
  tok/s          the run's post-warm-up median (ThroughputMonitor), and its ratio to the first variant

A variant is ``NAME=ARGS`` (more fit arguments, shell-quoted) or ``NAME@SRC=ARGS`` to run the
gpt_lightning package found in the source tree SRC instead, e.g. the previous version's, unpacked
with ``git archive main gpt_lightning | tar -x -C /tmp/before``:

    python benchmarks/first_step.py --config configs/tiny-cpu.yaml --rounds 2 --warm eager-eval \\
        --variant before@/tmp/before= --variant eager-eval= --variant "compile-eval=--model.compile_eval true"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer

REPO = Path(__file__).resolve().parents[1]


def _graphs() -> int:
    """Graphs Dynamo has compiled in this process so far (0 before torch.compile was touched)."""
    import torch._dynamo.utils

    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


class Timeline(Callback):
    """Wall-clock stamps (``time.time()``, comparable with the launching process) and Dynamo graph
    counts at the hooks that bound the sanity check, the first training step and validation; written
    as JSON to ``out`` when fit ends.

    Args:
        out: path of the JSON file to write.
    """

    def __init__(self, out: str) -> None:
        self.out = out
        self.stamps: dict[str, float] = {}
        self.graphs: dict[str, int] = {}
        self.validations: list[tuple[float, float]] = []  # (start, end) of each, sanity check excluded
        self._validation_start: float | None = None

    def _stamp(self, name: str) -> None:
        if name not in self.stamps:
            self.stamps[name] = time.time()
            self.graphs[name] = _graphs()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stamp("fit_start")

    def on_sanity_check_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stamp("sanity_start")

    def on_sanity_check_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stamp("sanity_end")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._stamp("first_step_start")

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step >= 1:  # the first optimizer step is done (accumulation included)
            self._stamp("first_step_end")

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._validation_start = time.time()
            self._stamp("first_validation_start")

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and self._validation_start is not None:
            self.validations.append((self._validation_start, time.time()))
            self._stamp("first_validation_end")

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._stamp("fit_end")
        # The ThroughputMonitor has summarized in on_train_end, which runs before on_fit_end.
        summary = next((cb.summary for cb in trainer.callbacks if isinstance(getattr(cb, "summary", None), dict)), None)
        Path(self.out).write_text(
            json.dumps(
                {
                    "stamps": self.stamps,
                    "graphs": self.graphs,
                    "validations": self.validations,
                    "throughput": summary,
                    "module_file": sys.modules[type(pl_module).__module__].__file__,  # which source tree ran
                }
            )
        )


def run_once(config: str, args: list[str], src: str | None, cache: Path, scratch: Path) -> dict[str, Any]:
    """One ``gpt-lightning fit`` in a fresh process, compiling into ``cache``; its timeline."""
    out = scratch / "timeline.json"
    out.unlink(missing_ok=True)
    callback = {"class_path": "first_step.Timeline", "init_args": {"out": str(out)}}
    command = [
        sys.executable,
        "-m",
        "gpt_lightning",
        "fit",
        "--config",
        str(Path(config).resolve()),
        *args,
        "--trainer.logger.init_args.save_dir",
        str(scratch / "logs"),
        f"--trainer.callbacks+={json.dumps(callback)}",
    ]
    # The package of SRC, else this checkout's; run from the scratch folder, since `python -m` puts
    # the working directory first on sys.path.
    paths = [str(Path(__file__).resolve().parent), src or str(REPO), os.environ.get("PYTHONPATH", "")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
    }
    launch = time.time()
    child = subprocess.run(command, env=env, capture_output=True, text=True, cwd=scratch)
    exited = time.time()
    if child.returncode != 0 or not out.exists():
        raise SystemExit(f"run failed (exit code {child.returncode}): {shlex.join(command)}\n{child.stderr[-4000:]}")
    timeline = json.loads(out.read_text())
    s, g = timeline["stamps"], timeline["graphs"]
    sanity = s["sanity_end"] - s["sanity_start"] if "sanity_start" in s else 0.0
    throughput = timeline["throughput"] or {}
    return {
        "to_first_step_s": s["first_step_start"] - launch,
        "sanity_s": sanity,
        "first_step_s": s["first_step_end"] - s["first_step_start"],
        "rest_s": s["fit_end"] - s["first_step_end"],
        "validation_s": sum(end - start for start, end in timeline["validations"]),
        "validations": len(timeline["validations"]),
        "first_validation_s": (s["first_validation_end"] - s["first_validation_start"])
        if "first_validation_end" in s
        else None,
        "total_s": exited - launch,
        "graphs_before_first_step": g["first_step_start"],
        "graphs_in_first_step": g["first_step_end"] - g["first_step_start"],
        "graphs_after_first_step": g["fit_end"] - g["first_step_end"],
        "tokens_per_sec_median": throughput.get("tokens_per_sec_median"),
        "first_step_s_monitor": throughput.get("first_step_s"),
        "compile_notices": (child.stdout + child.stderr).count("torch.compile: compiling"),
        "module_file": timeline["module_file"],
    }


def parse_variant(text: str) -> tuple[str, str | None, list[str]]:
    """``NAME[@SRC]=ARGS`` -> (name, source tree or None, fit arguments)."""
    head, _, args = text.partition("=")
    name, _, src = head.partition("@")
    if not name:
        raise SystemExit(f"--variant {text!r}: give NAME=ARGS or NAME@SRC=ARGS.")
    if src and not (Path(src) / "gpt_lightning" / "__init__.py").is_file():
        raise SystemExit(f"--variant {text!r}: {src} holds no gpt_lightning package.")
    return name, (str(Path(src).resolve()) if src else None), shlex.split(args)


FIGURES = ("to_first_step_s", "sanity_s", "first_step_s", "rest_s", "validation_s", "total_s")


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    row = {key: statistics.median(r[key] for r in runs) for key in FIGURES}
    for key in ("graphs_before_first_step", "graphs_in_first_step", "graphs_after_first_step"):
        row[key] = max(r[key] for r in runs)
    rates = [r["tokens_per_sec_median"] for r in runs if r["tokens_per_sec_median"]]
    row["tokens_per_sec_median"] = statistics.median(rates) if rates else None
    return row


def report(results: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    lines = [
        f"{'variant':<22} {'to 1st step':>11} {'sanity':>7} {'1st step':>9} {'rest':>7} {'valid.':>7} "
        f"{'total':>7} {'graphs b/in/a':>14} {'tok/s':>7} {'vs 1st':>7}"
    ]
    base = None
    for name, by_cache in results.items():
        for cache, runs in by_cache.items():
            if not runs:
                continue
            r = median_row(runs)
            rate = r["tokens_per_sec_median"]
            if base is None and rate:
                base = rate
            ratio = f"{rate / base:.3f}x" if rate and base else "-"
            graphs = f"{r['graphs_before_first_step']}/{r['graphs_in_first_step']}/{r['graphs_after_first_step']}"
            lines.append(
                f"{name + ' (' + cache + ')':<22} {r['to_first_step_s']:>10.1f}s {r['sanity_s']:>6.1f}s {r['first_step_s']:>8.1f}s "
                f"{r['rest_s']:>6.1f}s {r['validation_s']:>6.1f}s {r['total_s']:>6.1f}s {graphs:>14} "
                f"{rate or 0:>7,.0f} {ratio:>7}"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="YAML config, as for `gpt-lightning fit`.")
    parser.add_argument(
        "--variant",
        action="append",
        required=True,
        metavar="NAME[@SRC]=ARGS",
        help="a way to run the config; repeat. The first is the baseline of the tok/s ratio.",
    )
    parser.add_argument("--rounds", type=int, default=1, help="runs of each variant, alternating")
    parser.add_argument(
        "--warm",
        nargs="*",
        default=None,
        metavar="NAME",
        help="after each cold run of these variants (all, given no name), run again on the cache it filled",
    )
    parser.add_argument("--out", default=None, help="write every run's figures to this JSON file")
    args, extra = parser.parse_known_args()
    variants = [parse_variant(text) for text in args.variant]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {name: {"cold": [], "warm": []} for name, _, _ in variants}
    for round_index in range(args.rounds):
        for name, src, variant_args in variants:
            with tempfile.TemporaryDirectory(prefix=f"first-step-{name}-") as tmp:
                scratch = Path(tmp)
                warm = args.warm is not None and (not args.warm or name in args.warm)
                for cache in ("cold", "warm") if warm else ("cold",):
                    run = run_once(args.config, [*extra, *variant_args], src, scratch / "cache", scratch)
                    results[name][cache].append(run)
                    print(
                        f"round {round_index + 1} {name} ({cache}): "
                        + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in run.items()),
                        flush=True,
                    )
    print("\n" + report(results))
    if args.out:
        # Imported here, not at the top: variants' children import this file from their own source tree.
        from gpt_lightning.commands.bench import repo_relative

        Path(args.out).write_text(
            json.dumps(
                repo_relative(
                    {  # paths in this checkout, not the machine's
                        "config": args.config,
                        "arguments": extra,
                        "variants": args.variant,
                        "rounds": args.rounds,
                        "machine": f"{os.cpu_count()} CPUs",
                        "runs": results,
                        "medians": {
                            name: {cache: median_row(runs) for cache, runs in by.items() if runs}
                            for name, by in results.items()
                        },
                    },
                    REPO,
                ),
                indent=2,
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
