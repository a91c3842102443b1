"""Lightning must cost nothing: our Trainer loop vs a plain PyTorch loop, side by side.

Both train the same tiny GPT on the same batches at the same precision, from the same initial
weights and the same optimizer: once through ``GPTLightningModule`` + ``Trainer`` + the data
module + ``ThroughputMonitor`` (progress bar and TensorBoard logger on, as users run it), once
through a loop like the reference's. Runs alternate (plain, ours, ours, plain, ...) so drift in a
noisy machine hits both; each run's post-warm-up step times are pooled, and the medians compared.

    python benchmarks/lightning_overhead.py                 # eager and compiled, CPU defaults
    python benchmarks/lightning_overhead.py --compile true --steps 100 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch._dynamo
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger

from gpt_lightning import GPTLightningModule, ThroughputMonitor, TokenStreamDataModule
from gpt_lightning.commands.bench import repo_relative
from gpt_lightning.data.windows import TokenWindows


def make_module(args: argparse.Namespace, compiled: bool) -> GPTLightningModule:
    seed_everything(0, verbose=False)
    return GPTLightningModule(
        block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
        compile=compiled, val_sample_tokens=0,
    )


def plain_loop(args, data: TokenStreamDataModule, compiled: bool, device: torch.device) -> list[float]:
    """The reference's loop; returns the seconds of each step, measured end to end."""
    module = make_module(args, compiled).to(device)
    model = module.model
    if compiled:
        model.compile(dynamic=False)
    optimizer = module.configure_optimizers()
    windows = TokenWindows(data.tokens[: data.train_token_count], args.batch_size, args.block_size)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed")
    times, batches = [], iter(())
    last = time.perf_counter()
    for _ in range(args.steps):
        batch = next(batches, None)
        if batch is None:
            batches = iter(windows)
            batch = next(batches)
        x, y = (t.to(device, non_blocking=True) for t in batch)
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times[args.warmup :]


def lightning_loop(args, data: TokenStreamDataModule, compiled: bool, log_dir: str) -> list[float]:
    module = make_module(args, compiled)
    monitor = ThroughputMonitor(warmup_steps=args.warmup, filename=None)
    trainer = Trainer(
        accelerator=args.accelerator, devices=1, precision=args.precision, max_steps=args.steps,
        logger=TensorBoardLogger(log_dir, name="overhead"), callbacks=[monitor], enable_checkpointing=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    trainer.fit(module, data)
    return [s.seconds for s in monitor.steps if s.index >= args.warmup]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_path", default=None, help="text file; default: tiny Shakespeare")
    parser.add_argument("--accelerator", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", default=None, help="default: bf16-mixed on CUDA, 32-true on CPU")
    parser.add_argument("--compile", choices=["false", "true", "both"], default="both")
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of each run")
    parser.add_argument("--rounds", type=int, default=4, help="runs of each loop, alternated ABBA")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--n_layer", type=int, default=4)
    parser.add_argument("--n_head", type=int, default=4)
    parser.add_argument("--n_embd", type=int, default=128)
    parser.add_argument("--out", default="logs/benchmarks/lightning_overhead.json")
    args = parser.parse_args()
    args.precision = args.precision or ("bf16-mixed" if args.accelerator == "cuda" else "32-true")
    device = torch.device(args.accelerator)
    tokens_per_step = args.batch_size * args.block_size

    data = TokenStreamDataModule(args.data_path, batch_size=args.batch_size, block_size=args.block_size, val_fraction=0.0)
    data.prepare_data()
    data.setup("fit")
    results = {}
    modes = {"false": [False], "true": [True], "both": [False, True]}[args.compile]
    with tempfile.TemporaryDirectory() as log_dir:
        for compiled in modes:
            runs = {"plain": [], "lightning": []}  # each run's post-warm-up step seconds
            for round_index in range(args.rounds):
                order = ["plain", "lightning"] if round_index % 2 == 0 else ["lightning", "plain"]
                for which in order:
                    torch._dynamo.reset()
                    if which == "plain":
                        runs["plain"].append(plain_loop(args, data, compiled, device))
                    else:
                        runs["lightning"].append(lightning_loop(args, data, compiled, log_dir))
            pooled = {k: [t for run in v for t in run] for k, v in runs.items()}
            medians = {k: tokens_per_step / statistics.median(v) for k, v in pooled.items()}
            name = "compiled" if compiled else "eager"
            results[name] = {
                "plain_tokens_per_sec_median": medians["plain"],
                "lightning_tokens_per_sec_median": medians["lightning"],
                "ratio": medians["lightning"] / medians["plain"],
                "steps_measured_each": len(pooled["plain"]),
                # The spread between runs of one loop shows how much of the ratio is machine noise.
                "per_run_tokens_per_sec": {
                    k: [tokens_per_step / statistics.median(run) for run in v] for k, v in runs.items()
                },
            }
    print(f"\n{'mode':<9} {'plain tok/s':>12} {'lightning tok/s':>16} {'ratio':>7}   (target >= 0.98)")
    for name, r in results.items():
        print(f"{name:<9} {r['plain_tokens_per_sec_median']:>12,.0f} {r['lightning_tokens_per_sec_median']:>16,.0f} {r['ratio']:>7.3f}")
        for which, rates in r["per_run_tokens_per_sec"].items():
            print(f"    {which} runs: " + ", ".join(f"{rate:,.0f}" for rate in rates))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": repo_relative(vars(args)), "results": results}, indent=2) + "\n")
    print(f"saved {out}")


if __name__ == "__main__":
    main()
