"""The training step's levers that a GPU's defaults leave off until measured there, each on against the
defaults at one shape, into one JSON file: ``--model.chunked_loss`` (the loss a chunk of rows at a time)
and ``--model.cudnn_attention`` (cuDNN's attention kernel first on Hopper and newer). Each run is one of
``gpt-lightning bench``'s (a fresh process training ``--config`` through the CLI, the other arguments
going to every run): the defaults once, then each lever on. Per run: tokens/s after warm-up, peak memory,
the first 10 steps' losses; per lever, on against off (docs/gpu-fast-path.md, ``gpu_run.sh``'s ``levers``).

    python benchmarks/levers.py --config configs/gpt2-124m.yaml --model.compile_scope blocks \\
        --trainer.max_steps 30 --throughput.warmup_steps 10 --out benchmarks/results/<device>/levers.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from gpt_lightning.atomic import atomic_write_bytes
from gpt_lightning.commands.bench import compare, repo_relative, run_in_subprocess, train_one
from gpt_lightning.training.attention import device_attention_backends

# Each lever's flag; on a GPU the defaults leave them off.
LEVERS = {"chunked_loss": "--model.chunked_loss", "cudnn_attention": "--model.cudnn_attention"}
LOSS_STEPS = 10  # the steps whose losses are compared


def run_row(run: dict[str, Any]) -> dict[str, Any]:
    """One run's figures: bench's summary row (no eager to compare with) and its first losses."""
    row = compare(run, None)
    keep = ("tokens_per_sec_median", "step_ms_median", "first_step_s", "compile_time_s", "mfu", "peak_memory_bytes")
    return {**{key: row[key] for key in keep}, "losses": run["loss"][:LOSS_STEPS]}


def lever_row(on: dict[str, Any], off: dict[str, Any], applies: bool) -> dict[str, Any]:
    """A lever on against off (the defaults' run): the ratio of tokens/s, the memory it saves, the
    largest difference of the first losses; ``applies``: whether this device takes the lever at all."""
    ratio = None
    if on["tokens_per_sec_median"] and off["tokens_per_sec_median"]:
        ratio = on["tokens_per_sec_median"] / off["tokens_per_sec_median"]
    saved = None
    if on["peak_memory_bytes"] is not None and off["peak_memory_bytes"] is not None:
        saved = off["peak_memory_bytes"] - on["peak_memory_bytes"]
    diffs = [abs(a - b) for a, b in zip(on["losses"], off["losses"])]
    return {
        "applies": applies,
        "tokens_per_sec_on_over_off": ratio,
        "peak_memory_saved_bytes": saved,
        "max_loss_diff": max(diffs) if diffs else None,
    }


def cudnn_attention_applies() -> bool:
    """Whether this machine's GPU would run the training forward on cuDNN attention (asked last: it
    starts CUDA in this process, which the runs' peak memory must not share)."""
    return (
        torch.cuda.is_available() and device_attention_backends(torch.device("cuda"), cudnn_attention=True) is not None
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML config, as for `gpt-lightning fit`")
    parser.add_argument("--levers", nargs="+", choices=list(LEVERS), default=list(LEVERS))
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    parser.add_argument(
        "--in_process",
        action="store_true",
        help="every run in this process, one after another: the wiring in seconds (gpu_run.sh --dry-run); "
        "their peak memory is the process's, not comparable",
    )
    args, extra = parser.parse_known_args(argv)
    parent = f"levers/{Path(args.config).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    planned = [("defaults", [])] + [(f"{lever}_on", [LEVERS[lever], "true"]) for lever in args.levers]
    rows: dict[str, dict[str, Any]] = {}
    report: dict[str, Any] = {
        "config": args.config,
        "arguments": extra,
        "loss_steps": LOSS_STEPS,
        "in_process": args.in_process,
    }
    for name, flags in planned:  # written after each run: a run cut short keeps the ones before
        naming = ["--trainer.logger.init_args.name", parent, "--trainer.logger.init_args.version", name]
        run_args = ["--config", args.config, *extra, *naming, *flags]
        run = train_one(run_args) if args.in_process else run_in_subprocess(name, run_args, cold=False)
        rows[name] = {"args": flags, **run_row(run)}
        report.setdefault("device", (run["summary"] or {}).get("device"))
        report["runs"] = rows
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(args.out, (json.dumps(repo_relative(report), indent=2) + "\n").encode())
    # whether the lever changes this device's step: a CPU's defaults chunk the loss already
    applies = {"chunked_loss": torch.cuda.is_available(), "cudnn_attention": cudnn_attention_applies()}
    report["levers"] = {
        lever: lever_row(rows[f"{lever}_on"], rows["defaults"], applies[lever]) for lever in args.levers
    }
    atomic_write_bytes(args.out, (json.dumps(repo_relative(report), indent=2) + "\n").encode())
    print(f"\n{'lever':<16} {'applies':>8} {'tok/s on/off':>13} {'memory saved GB':>16} {'max |Δloss|':>12}")
    for lever, row in report["levers"].items():
        ratio, saved, diff = row["tokens_per_sec_on_over_off"], row["peak_memory_saved_bytes"], row["max_loss_diff"]
        print(
            f"{lever:<16} {str(row['applies']):>8} {'-' if ratio is None else f'{ratio:.3f}':>13} "
            f"{'-' if saved is None else f'{saved / 1e9:.2f}':>16} {'-' if diff is None else f'{diff:.4f}':>12}"
        )
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
