"""``gpt-lightning bench``: one config trained several ways, each in its own process, side by side;
exits 1 if a compiled run's loss leaves eager's by more than ``--tolerance`` (docs/benchmarks.md)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer

from gpt_lightning.atomic import atomic_output, atomic_write_bytes
from gpt_lightning.errors import UserError
from gpt_lightning.observing.roofline import matmul_flops_per_sec
from gpt_lightning.observing.throughput import ThroughputMonitor, precision_dtype

# What each run adds to the shared arguments.
RUNS = {
    "eager": ["--model.compile", "false"],
    "compiled": ["--model.compile", "true"],
    "model": ["--model.compile", "true", "--model.compile_scope", "model"],
    "blocks": ["--model.compile", "true", "--model.compile_scope", "blocks"],
}


class LossRecorder(Callback):
    """Keeps each optimizer step's loss (summed over micro-batches) as a device tensor, read at the end."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self._step_sum: torch.Tensor | None = None  # the current step's micro-batches so far
        self._last_global_step = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._step_sum, self._last_global_step = None, trainer.global_step

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs["loss"].detach()
        self._step_sum = loss if self._step_sum is None else self._step_sum + loss
        if trainer.global_step != self._last_global_step:  # this micro-batch ended an optimizer step
            self._last_global_step = trainer.global_step
            self.losses.append(self._step_sum)
            self._step_sum = None

    def values(self) -> list[float]:
        return torch.stack(self.losses).float().cpu().tolist() if self.losses else []


def train_one(args: list[str]) -> dict[str, Any]:
    """Train once, in this process, through ``GPTLightningCLI``; losses, timings and the summary."""
    from gpt_lightning.lightning_cli import GPTLightningCLI

    with warnings.catch_warnings():  # args are built by the parent bench on purpose
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter is intended.*")
        cli = GPTLightningCLI(run=False, args=args, parser_kwargs={"prog": "gpt-lightning fit"})
    recorder = LossRecorder()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, cli.datamodule)
    monitor = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ThroughputMonitor))
    return {
        "log_dir": cli.trainer.log_dir,
        "compiled": cli.model.is_compiled,
        "compile_scope": cli.model.hparams.compile_scope,
        "loss": recorder.values(),
        "step_ms": [1000 * s.seconds for s in monitor.steps],
        "tokens_per_sec": [cli.trainer.world_size * s.tokens / s.seconds for s in monitor.steps],
        "summary": monitor.summary,
        "bound": training_bound(cli.trainer, (monitor.summary or {}).get("flops_per_token")),
    }


def training_bound(trainer: Trainer, flops_per_token: float | None) -> dict[str, Any] | None:
    """The tokens/s no run of this model passes here: training FLOPs per token over the matmul FLOP/s
    of the run's dtype measured on its device after training. None without FLOPs."""
    if not flops_per_token:
        return None
    dtype = precision_dtype(str(trainer.precision))
    peak = matmul_flops_per_sec(trainer.strategy.root_device, dtype)
    return {
        "matmul_dtype": str(dtype).removeprefix("torch."),
        "matmul_flops_per_sec": peak,
        "flops_per_token": flops_per_token,
        "tokens_per_sec": trainer.world_size * peak / flops_per_token,
    }


def repository_root() -> Path:
    """The checkout this package runs from (holding its pyproject.toml), else the working directory."""
    import gpt_lightning

    source = Path(gpt_lightning.__file__).resolve().parents[1]
    return source if (source / "pyproject.toml").is_file() else Path.cwd().resolve()


def repo_relative(value: Any, root: Path | None = None) -> Any:
    """``value`` (JSON-like) with absolute paths under ``root`` (default: the repository) made relative."""
    root = repository_root() if root is None else root
    under = re.compile(r"(^|=)" + re.escape(str(root).rstrip("/") + "/"))
    if isinstance(value, str):
        return "." if value == str(root) else under.sub(r"\1", value)
    if isinstance(value, dict):
        return {key: repo_relative(item, root) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [repo_relative(item, root) for item in value]
    return value


def run_in_subprocess(name: str, args: list[str], cold: bool) -> dict[str, Any]:
    """``train_one(args)`` in a fresh Python process; ``cold``: with empty compile caches of its own,
    merged afterwards into the caller's."""
    with tempfile.TemporaryDirectory(prefix=f"bench-{name}-") as scratch:
        result = Path(scratch) / "result.json"
        env = dict(os.environ)
        caches = {"TORCHINDUCTOR_CACHE_DIR": Path(scratch) / "inductor", "TRITON_CACHE_DIR": Path(scratch) / "triton"}
        if cold:
            env.update({key: str(path) for key, path in caches.items()})
        print(f"\n=== {name}: {' '.join(args)}{' (cold compile cache)' if cold else ''}", flush=True)
        child = subprocess.run(
            [sys.executable, "-m", "gpt_lightning.commands.bench", "--child", str(result), *args], env=env
        )
        for key, path in caches.items():
            if cold and os.environ.get(key) and path.is_dir():
                shutil.copytree(path, os.environ[key], dirs_exist_ok=True)
        if child.returncode != 0:
            raise UserError(f"bench run {name!r} failed (exit code {child.returncode}); its error is printed above.")
        if not result.exists():  # the run only printed something (--print_config, --help): so are we done
            raise SystemExit(0)
        return {"name": name, "args": args, **json.loads(result.read_text())}


def compare(run: dict[str, Any], eager: dict[str, Any] | None, window: int = 10) -> dict[str, Any]:
    """One summary row: the run's figures, speedup and largest ``window``-step mean loss difference
    against eager (``max_loss_diff_step``: the window's first step), and of single steps."""
    s, bound = run["summary"] or {}, run.get("bound") or {}
    row: dict[str, Any] = {
        "tokens_per_sec_median": s.get("tokens_per_sec_median"),
        "bound_tokens_per_sec": bound.get("tokens_per_sec"),
        "fraction_of_bound": (
            s["tokens_per_sec_median"] / bound["tokens_per_sec"] if s and bound.get("tokens_per_sec") else None
        ),
        "step_ms_median": s.get("step_ms_median"),
        "first_step_s": s.get("first_step_s"),
        "compile_time_s": (s["first_step_s"] - s["step_ms_median"] / 1000) if s and run["compiled"] else None,
        "mfu": s.get("mfu"),
        "peak_memory_bytes": s.get("peak_device_memory_bytes") or s.get("peak_host_rss_bytes"),
        "speedup_vs_eager": None,
        "max_loss_diff_vs_eager": None,
        "max_loss_diff_step": None,
        "max_step_loss_diff_vs_eager": None,
    }
    if eager is not None and run is not eager:
        e = eager["summary"]
        if e and s:
            row["speedup_vs_eager"] = s["tokens_per_sec_median"] / e["tokens_per_sec_median"]
        steps = min(len(eager["loss"]), len(run["loss"]))
        pairs = list(zip(eager["loss"][:steps], run["loss"][:steps]))
        diffs = [
            abs(sum(a - b for a, b in pairs[i : i + window])) / len(pairs[i : i + window])
            for i in range(0, steps, window)
        ]
        if diffs:
            row["max_loss_diff_vs_eager"] = max(diffs)
            row["max_loss_diff_step"] = window * diffs.index(max(diffs))
            row["max_step_loss_diff_vs_eager"] = max(abs(a - b) for a, b in zip(eager["loss"], run["loss"]))
    return row


def table(runs: list[dict[str, Any]], every: int) -> str:
    header = f"{'step':>5} | " + " | ".join(f"{run['name'] + ' loss':>14} {'ms':>9}" for run in runs)
    rows = [header]
    for i in range(0, min(min(len(run["loss"]), len(run["step_ms"])) for run in runs), every):
        rows.append(f"{i:>5} | " + " | ".join(f"{run['loss'][i]:>14.4f} {run['step_ms'][i]:>9.2f}" for run in runs))
    return "\n".join(rows)


def summary_table(runs: list[dict[str, Any]], rows: dict[str, dict[str, Any]], window: int = 10) -> str:
    def fmt(value: Any, spec: str, missing: str = "-") -> str:
        return missing if value is None else format(value, spec)

    lines = [
        f"{'run':<10} {'tok/s':>10} {'bound tok/s':>12} {'of bound':>9} {'step ms':>9} {'first step s':>13} "
        f"{'MFU':>6} {'peak mem GB':>12} {'vs eager':>9} {'max |Δloss|':>12}"
    ]
    for run in runs:
        r = rows[run["name"]]
        memory = None if r["peak_memory_bytes"] is None else r["peak_memory_bytes"] / 1e9
        diff = (
            "-"
            if r["max_loss_diff_vs_eager"] is None
            else f"{r['max_loss_diff_vs_eager']:.4f} @{r['max_loss_diff_step']}"
        )
        lines.append(
            f"{run['name']:<10} {fmt(r['tokens_per_sec_median'], ',.0f'):>10} "
            f"{fmt(r['bound_tokens_per_sec'], ',.0f'):>12} {fmt(r['fraction_of_bound'], '.1%'):>9} "
            f"{fmt(r['step_ms_median'], '.1f'):>9} {fmt(r['first_step_s'], '.2f'):>13} {fmt(r['mfu'], '.1%'):>6} "
            f"{fmt(memory, '.2f'):>12} "
            f"{fmt(r['speedup_vs_eager'], '.2f') + ('x' if r['speedup_vs_eager'] else ''):>9} {diff:>12}"
        )
    peaks = {
        f"{b['matmul_dtype']} {b['matmul_flops_per_sec'] / 1e12:.3g} TFLOP/s"
        for b in (run.get("bound") for run in runs)
        if b
    }
    lines.append(
        "bound tok/s: training FLOPs per token over the matmul FLOP/s measured in each run's process "
        f"({', '.join(sorted(peaks)) or 'no FLOPs counted'}); of bound: tok/s over it"
    )
    lines.append(f"max |Δloss|: the largest difference from eager's mean loss over {window} steps (@ their first step)")
    return "\n".join(lines)


def chart(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for run in runs:
        top.plot(run["tokens_per_sec"], label=run["name"])
        bottom.plot(run["loss"], label=run["name"])
    top.set_ylabel("tokens/sec")
    top.set_yscale("log")
    top.set_title("throughput per optimizer step (first steps include compilation)")
    bottom.set_ylabel("train loss")
    bottom.set_xlabel("step")
    for axis in (top, bottom):
        axis.legend()
        axis.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="gpt-lightning bench",
        description="Train one config several ways (eager, compiled, by compile scope), each in its own "
        "process, and compare throughput, first step and loss. Other arguments are fit's "
        "(e.g. --trainer.max_steps 50) and go to every run.",
    )
    parser.add_argument("--config", required=True, help="YAML config, as for `gpt-lightning fit`.")
    parser.add_argument(
        "--runs",
        nargs="+",
        choices=list(RUNS),
        default=["eager", "compiled"],
        help="how to train --config: eager, compiled (as the config says), model or blocks (compile scopes; default: %(default)s)",
    )
    parser.add_argument("--also", nargs="*", default=[], metavar="CONFIG", help="more configs, each run as written")
    parser.add_argument("--cold", action="store_true", help="each run starts from an empty inductor cache")
    parser.add_argument("--every", type=int, default=10, help="print a table row every N steps (default: %(default)s)")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.5,
        help="largest allowed difference of eager's and a compiled run's mean loss over any --window "
        "steps; beyond it the bench exits 1 (default: %(default)s)",
    )
    parser.add_argument("--window", type=int, default=10, help="steps per mean loss for --tolerance (default: 10)")
    parser.add_argument("--out", type=Path, help="folder for bench.json and bench.png (default: beside the runs' logs)")
    args, extra = parser.parse_known_args(argv)
    parent = f"bench/{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"

    def run_args(config: str, name: str) -> list[str]:
        naming = ["--trainer.logger.init_args.name", parent, "--trainer.logger.init_args.version", name]
        return ["--config", config, *extra, *naming]

    planned = [(name, [*run_args(args.config, name), *RUNS[name]]) for name in args.runs]
    planned += [(Path(config).stem, run_args(config, Path(config).stem)) for config in args.also]
    runs: list[dict[str, Any]] = []
    for name, run_argv in planned:  # bench.json after each run: a run killed later keeps the ones before
        runs.append(run_in_subprocess(name, run_argv, args.cold))
        rows, out_dir = save(args, extra, runs)
    print("\n" + table(runs, args.every) + "\n")
    print(summary_table(runs, rows, args.window))
    print(
        f"\nsaved {out_dir / 'bench.json'} and {out_dir / 'bench.png'}; TensorBoard: tensorboard --logdir {Path(runs[0]['log_dir']).parent}"
    )
    if any(run["summary"] is None for run in runs):
        print(
            "Too few steps for post-warm-up statistics: raise --trainer.max_steps or lower --throughput.warmup_steps."
        )
    diffs = {name: r["max_loss_diff_vs_eager"] for name, r in rows.items()}
    diverged = [name for name, diff in diffs.items() if diff is not None and diff > args.tolerance]
    for name in diverged:
        first = rows[name]["max_loss_diff_step"]
        print(
            f"FAIL: {name}'s loss curve leaves eager's: |Δ mean loss| = {diffs[name]:.4f} over steps "
            f"{first}-{first + args.window - 1}, beyond the tolerance {args.tolerance}."
        )
    if diverged:
        raise SystemExit(1)


def save(
    args: argparse.Namespace, extra: list[str], runs: list[dict[str, Any]]
) -> tuple[dict[str, dict[str, Any]], Path]:
    """bench.json and bench.png of the runs so far; their summary rows and the folder written."""
    eager = next((run for run in runs if run["name"] == "eager"), None)
    base = [run for run in runs if run["name"] in RUNS]
    rows = {run["name"]: compare(run, eager if run in base else None, args.window) for run in runs}
    out_dir = args.out or Path(runs[0]["log_dir"]).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "config": args.config,
        "also": args.also,
        "cold_compile_cache": args.cold,
        "arguments": extra,
        "device": next((run["summary"]["device"] for run in runs if run["summary"]), None),
        "tolerance": args.tolerance,
        "window": args.window,
        "summary": rows,
        "runs": {run["name"]: {k: v for k, v in run.items() if k != "name"} for run in runs},
    }
    atomic_write_bytes(out_dir / "bench.json", (json.dumps(repo_relative(result), indent=2) + "\n").encode())
    chart(runs, out_dir / "bench.png")
    return rows, out_dir


def _child(argv: list[str]) -> None:
    """``python -m gpt_lightning.commands.bench --child RESULT ARGS...``: one run, for ``main``."""
    assert argv[0] == "--child", argv
    result_path, args = Path(argv[1]), argv[2:]
    try:
        result = train_one(args)
    except (UserError, MisconfigurationException) as err:
        print(f"gpt-lightning: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    atomic_write_bytes(result_path, json.dumps(result).encode())


if __name__ == "__main__":
    _child(sys.argv[1:])
