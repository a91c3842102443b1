"""``gpt-lightning bench``: one config trained eager, then compiled, side by side.

Same config, same seed, same batches; the reference's table every ``--every`` steps, then the
post-warm-up median tokens/sec of each run, the speedup, the compile time and the largest loss
difference. Both runs log to TensorBoard under one parent so their curves overlay; the result is
saved as ``bench.json`` and ``bench.png`` there. Exits 1 if the loss curves diverge.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch._dynamo
from lightning.pytorch import Callback, LightningModule, Trainer

from gpt_lightning.lightning_cli import GPTLightningCLI
from gpt_lightning.atomic import atomic_output, atomic_write_bytes
from gpt_lightning.throughput import ThroughputMonitor


class LossRecorder(Callback):
    """Keeps every training loss as a device tensor: read once at the end, no per-step sync."""

    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(outputs["loss"].detach())

    def values(self) -> list[float]:
        return torch.stack(self.losses).float().cpu().tolist() if self.losses else []


def run_once(config: str, compiled: bool, parent: str, extra: list[str]) -> dict[str, Any]:
    """Train ``config`` once; return its per-step losses and timings and its throughput summary."""
    torch._dynamo.reset()
    name = "compiled" if compiled else "eager"
    with warnings.catch_warnings():  # args are built from our own argv on purpose
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter is intended.*")
        cli = GPTLightningCLI(
            run=False,
            parser_kwargs={"prog": "gpt-lightning fit"},  # its options are fit's: that --help lists them
            args=[
                "--config", config, *extra,
                "--model.compile", str(compiled).lower(),
                "--trainer.logger.init_args.name", parent,
                "--trainer.logger.init_args.version", name,
            ],
        )
    recorder = LossRecorder()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, cli.datamodule)
    monitor = next(cb for cb in cli.trainer.callbacks if isinstance(cb, ThroughputMonitor))
    return {
        "name": name,
        "log_dir": cli.trainer.log_dir,
        "loss": recorder.values(),
        "step_ms": [1000 * s.seconds for s in monitor.steps],
        "tokens_per_sec": [cli.trainer.world_size * s.tokens / s.seconds for s in monitor.steps],
        "summary": monitor.summary,
        "save_dir": cli.trainer.logger.save_dir,
    }


def table(eager: dict, compiled: dict, every: int) -> str:
    rows = [
        f"{'step':>5} | {'eager loss':>10} {'ms':>9} {'tok/s':>11} | {'compiled loss':>13} {'ms':>9} {'tok/s':>11}",
    ]
    for i in range(0, min(len(eager["loss"]), len(compiled["loss"])), every):
        rows.append(
            f"{i:>5} | {eager['loss'][i]:>10.4f} {eager['step_ms'][i]:>9.2f} {eager['tokens_per_sec'][i]:>11.0f} | "
            f"{compiled['loss'][i]:>13.4f} {compiled['step_ms'][i]:>9.2f} {compiled['tokens_per_sec'][i]:>11.0f}"
        )
    return "\n".join(rows)


def chart(eager: dict, compiled: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for run in (eager, compiled):
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
        description="Train one config eager, then compiled, and compare throughput and loss. "
        "Other arguments (e.g. --trainer.max_steps 50) are passed to both runs.",
    )
    parser.add_argument("--config", required=True, help="YAML config, as for `gpt-lightning fit`.")
    parser.add_argument("--every", type=int, default=10, help="print a table row every N steps")
    parser.add_argument(
        "--tolerance", type=float, default=0.25,
        help="largest allowed |loss_eager - loss_compiled| at any step; beyond it the bench exits 1",
    )
    args, extra = parser.parse_known_args(argv)
    parent = f"bench/{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"

    eager = run_once(args.config, False, parent, extra)
    compiled = run_once(args.config, True, parent, extra)
    out_dir = Path(compiled["log_dir"]).parent
    diffs = [abs(a - b) for a, b in zip(eager["loss"], compiled["loss"])]
    max_diff = max(diffs) if diffs else 0.0
    worst_step = diffs.index(max_diff) if diffs else 0
    e, c = eager["summary"], compiled["summary"]
    result = {
        "config": args.config,
        "eager_tokens_per_sec_median": e and e["tokens_per_sec_median"],
        "compiled_tokens_per_sec_median": c and c["tokens_per_sec_median"],
        "speedup": (c["tokens_per_sec_median"] / e["tokens_per_sec_median"]) if e and c else None,
        "compiled_first_step_s": c and c["first_step_s"],
        "eager_first_step_s": e and e["first_step_s"],
        "compile_time_s": (c["first_step_s"] - c["step_ms_median"] / 1000) if c else None,
        "max_loss_diff": max_diff,
        "max_loss_diff_step": worst_step,
        "tolerance": args.tolerance,
        "runs": {run["name"]: {k: run[k] for k in ("loss", "step_ms", "tokens_per_sec", "summary", "log_dir")}
                 for run in (eager, compiled)},
    }
    print(table(eager, compiled, args.every))
    if e and c:
        print(
            f"\npost-warm-up median: eager {e['tokens_per_sec_median']:,.0f} tok/s, compiled "
            f"{c['tokens_per_sec_median']:,.0f} tok/s, speedup {result['speedup']:.2f}x; compile time "
            f"{result['compile_time_s']:.1f} s; largest loss difference {max_diff:.4f} at step {worst_step}"
        )
    else:
        print("\nToo few steps for post-warm-up statistics: raise --trainer.max_steps or lower --throughput.warmup_steps.")
    atomic_write_bytes(out_dir / "bench.json", (json.dumps(result, indent=2) + "\n").encode())
    chart(eager, compiled, out_dir / "bench.png")
    print(f"saved {out_dir / 'bench.json'} and {out_dir / 'bench.png'}; TensorBoard: tensorboard --logdir {out_dir}")
    if max_diff > args.tolerance:
        print(
            f"FAIL: the loss curves diverge: |eager - compiled| = {max_diff:.4f} at step {worst_step}, "
            f"beyond the tolerance {args.tolerance}."
        )
        raise SystemExit(1)
