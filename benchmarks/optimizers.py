"""Tokens to a given loss: AdamW against Muon (``GPTLightningModule(optimizer="muon")``), side by side.

The same GPT of this package, data (tiny Shakespeare, GPT-2 tokens), token budget, schedule
(warm-up, stable, linear decay: ``lr_schedule="wsd"``) and seed for every run. AdamW's learning rate
is swept, then Muon's (its AdamW part at the best AdamW rate); optionally two Muon variants at one
rate: Q, K and V orthogonalized separately (``--qkv_split``, modded-nanogpt's split of the fused
``c_attn``) and the momentum warmed up 0.85 -> 0.95 (``--momentum_warmup``). Every run steps in
lockstep with the others, one step each in a rotating order, so the machine's load falls on all of
them alike and the time-per-step ratios are measured side by side. Validation loss every
``--eval_every`` steps on the same held-out windows.

For each run: its final validation loss, the tokens it needed to reach the best AdamW run's final
validation loss (interpolated between evaluations), and its median time per step. Writes
``optimizers.json`` and ``optimizers.png`` (validation loss against tokens) to ``--out``.

``--guarded_step`` measures instead what Muon's optimizer step costs when the ``NonFiniteGuard``
sets ``found_inf`` (every step of a real run): the median step time and the peak memory the step
allocates beyond the model, gradients and optimizer state (CUDA: the allocator's peak; CPU: the
bytes of the tensors the step creates that are alive at once). Writes ``guarded_step.json``.

    OMP_NUM_THREADS=1 python benchmarks/optimizers.py --qkv_split --momentum_warmup   # benchmarks/results/cpu-2core/
    python benchmarks/optimizers.py --guarded_step --n_layer 4 --n_embd 256 --block_size 64 --steps 10
    python benchmarks/optimizers.py --device cuda --n_layer 12 --n_head 12 --n_embd 768 --batch_size 16 --block_size 1024 ...

The vocabulary is the GPT-2 tokens tiny Shakespeare uses, renumbered densely (``--compact_vocab``,
the default on a CPU): the 50257-row head would otherwise be most of a small model's step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import weakref
from pathlib import Path

import lockstep
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from gpt_lightning.model import GPT, GPTConfig
from gpt_lightning.training.optimizers import build_optimizer, muon_matrix_step

tokens_to_reach = lockstep.tokens_to_reach


class Run(lockstep.Run):
    """A GPT-2 of the benchmark's shape and its AdamW or Muon, with the Muon variants' changes."""

    def __init__(
        self,
        name: str,
        args: argparse.Namespace,
        vocab: int,
        optimizer: str,
        lr: float,
        muon_lr: float,
        qkv_split: bool = False,
        momentum_warmup: bool = False,
    ) -> None:
        torch.manual_seed(args.seed)  # the same initial weights for every run
        self.args = args
        config = GPTConfig(
            vocab_size=vocab,
            block_size=args.block_size,
            n_layer=args.n_layer,
            n_head=args.n_head,
            n_embd=args.n_embd,
            dropout=0.0,
            bias=True,
        )
        model = GPT(config).to(args.device)
        built = build_optimizer(
            model,
            optimizer,
            learning_rate=lr,
            weight_decay=0.01,
            betas=(0.9, 0.95),
            eps=1e-8,
            fused=True,
            muon_learning_rate=muon_lr,
            muon_momentum=0.95,
            muon_weight_decay=0.0,
            muon_adjust_lr="original",
        )
        super().__init__(name, model, built, args)
        self.settings = dict(
            optimizer=optimizer,
            learning_rate=lr,
            muon_learning_rate=muon_lr if optimizer == "muon" else None,
            qkv_split=qkv_split,
            momentum_warmup=momentum_warmup,
        )
        self.momentum_warmup = momentum_warmup
        if qkv_split:
            split_qkv(self.optimizer, self.model)

    def before_step(self, step: int) -> None:
        if self.momentum_warmup:  # 0.85 -> 0.95 over the first 0.3 of the run (modded-nanogpt: 300 steps)
            frac = min(1.0, step / (0.3 * self.args.steps))
            self.optimizer.param_groups[0]["momentum"] = 0.85 + 0.10 * frac


def split_qkv(optimizer: torch.optim.Optimizer, model: GPT) -> None:
    """Make Muon orthogonalize each of c_attn's Q, K and V blocks on its own (modded-nanogpt), by
    stepping the fused matrix through three views. Measured here only: torch.optim.Muon has no such option."""
    muon = optimizer.muon
    attn = {id(block.attn.c_attn.weight) for block in model.transformer.h}
    plain_step = muon.step

    @torch.no_grad()
    def step(closure=None):
        group = muon.param_groups[0]
        kept = [p for p in group["params"] if id(p) not in attn]
        fused = [p for p in group["params"] if id(p) in attn and p.grad is not None]
        group["params"] = kept
        plain_step()
        group["params"] = kept + fused  # the order is only the group's listing
        for p in fused:
            muon_matrix_step(p, group, muon.state[p], chunks=3)  # Q, K, V: (C, C) each

    muon.step = step


class LiveTensorPeak(TorchDispatchMode):
    """The most bytes held at once by tensors created inside the mode (in-place results and views
    are not new memory): a CPU stand-in for ``torch.cuda.max_memory_allocated`` that is exact and
    does not depend on the allocator."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._schema.is_mutable or func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                nbytes = t.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._freed, nbytes)
        return out


def guarded_step(args: argparse.Namespace, vocab: int) -> dict:
    """Muon's step as the guard runs it (``found_inf`` set, finite): median time and peak extra memory."""
    torch.manual_seed(args.seed)
    config = GPTConfig(
        vocab_size=vocab,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=0.0,
        bias=True,
    )
    model = GPT(config).to(args.device)
    optimizer = build_optimizer(
        model,
        "muon",
        learning_rate=1e-3,
        weight_decay=0.01,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
        muon_learning_rate=0.02,
        muon_momentum=0.95,
        muon_weight_decay=0.01,
        muon_adjust_lr="original",
    )
    x = torch.randint(0, vocab, (args.batch_size, args.block_size), device=args.device)
    model(x, x)[1].backward()
    optimizer.found_inf = torch.zeros((), device=args.device)
    optimizer.step()  # the state exists from here on, as in every step of a run but the first
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    seconds = []
    for _ in range(args.steps):
        sync()
        start = time.perf_counter()
        optimizer.step()
        sync()
        seconds.append(time.perf_counter() - start)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        optimizer.step()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        with LiveTensorPeak() as tracker:
            optimizer.step()
        peak = tracker.peak
    muon_bytes = sum(p.numel() * p.element_size() for p in optimizer.muon.param_groups[0]["params"])
    return {
        "what": "MuonWithAdamW.step with found_inf set (the guarded step), benchmarks/optimizers.py --guarded_step",
        "shape": {
            k: getattr(args, k) for k in ("device", "n_layer", "n_head", "n_embd", "batch_size", "block_size", "steps")
        },
        "vocab_size": vocab,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "median_step_ms": round(1000 * statistics.median(seconds), 2),
        "peak_step_bytes": peak,
        "muon_weight_bytes": muon_bytes,
        "peak_over_muon_weights": round(peak / muon_bytes, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu-2core"))
    lockstep.add_arguments(parser)
    parser.add_argument("--adamw_lrs", type=float, nargs="+", default=[1e-3, 3e-3, 1e-2])
    parser.add_argument("--muon_lrs", type=float, nargs="+", default=[0.01, 0.02, 0.04])
    parser.add_argument(
        "--muon_adamw_lr", type=float, default=None, help="the AdamW part's lr under Muon; default: the middle AdamW lr"
    )
    parser.add_argument(
        "--qkv_split",
        action="store_true",
        help="add a Muon run at the middle Muon lr with Q, K, V orthogonalized apart",
    )
    parser.add_argument(
        "--momentum_warmup", action="store_true", help="add a Muon run at the middle Muon lr with momentum 0.85 -> 0.95"
    )
    parser.add_argument(
        "--guarded_step",
        action="store_true",
        help="measure Muon's guarded optimizer step only (time, peak memory): guarded_step.json",
    )
    args = parser.parse_args()
    torch.set_float32_matmul_precision("high")
    compact = args.compact_vocab if args.compact_vocab is not None else args.device == "cpu"
    ids, vocab = lockstep.tokens(compact)
    if args.guarded_step:
        report = guarded_step(args, vocab)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "guarded_step.json").write_text(json.dumps(report, indent=1) + "\n")
        print(json.dumps(report))
        return
    data = lockstep.Data(ids, args, args.seed)  # the same windows for every run
    B, T = args.batch_size, args.block_size

    muon_adamw_lr = args.muon_adamw_lr or args.adamw_lrs[len(args.adamw_lrs) // 2]
    mid_muon = args.muon_lrs[len(args.muon_lrs) // 2]
    runs = [Run(f"adamw lr={lr:g}", args, vocab, "adamw", lr, 0.0) for lr in args.adamw_lrs]
    runs += [Run(f"muon lr={lr:g}", args, vocab, "muon", muon_adamw_lr, lr) for lr in args.muon_lrs]
    if args.qkv_split:
        runs.append(
            Run(f"muon lr={mid_muon:g} qkv split", args, vocab, "muon", muon_adamw_lr, mid_muon, qkv_split=True)
        )
    if args.momentum_warmup:
        runs.append(
            Run(
                f"muon lr={mid_muon:g} momentum warm-up",
                args,
                vocab,
                "muon",
                muon_adamw_lr,
                mid_muon,
                momentum_warmup=True,
            )
        )

    wall_s = lockstep.train_in_lockstep(runs, data, args)

    adamw = [r for r in runs if r.settings["optimizer"] == "adamw"]
    best_adamw = min(adamw, key=lambda r: r.curve[-1][1])
    target, budget = best_adamw.curve[-1][1], args.steps * B * T
    plain_muon = [
        r for r in runs if r.settings["optimizer"] == "muon" and not (r.settings["qkv_split"] or r.momentum_warmup)
    ]
    best_muon = min(plain_muon, key=lambda r: r.curve[-1][1])  # of the lr sweep; the variants are compared to it
    step_s = {r.name: r.median_step_s() for r in runs}  # past warm-up
    results = []
    for r in runs:
        reached = tokens_to_reach(r.curve, target)
        results.append(
            {
                "name": r.name,
                **r.settings,
                "final_val_loss": round(r.curve[-1][1], 4),
                "tokens_to_best_adamw_final": None if reached is None else round(reached),
                "tokens_ratio_vs_best_adamw": None if reached is None else round(reached / budget, 3),
                "median_step_ms": round(1000 * step_s[r.name], 2),
                "step_time_ratio_vs_best_adamw": round(step_s[r.name] / step_s[best_adamw.name], 3),
                "curve": [[t, round(loss, 4)] for t, loss in r.curve],
            }
        )
    report = {
        "what": "validation loss against tokens, AdamW vs Muon, one lockstep run (benchmarks/optimizers.py)",
        "shape": {k: getattr(args, k) for k in (*lockstep.SHAPE, "seed")},
        "vocab_size": vocab,
        "compact_vocab": compact,
        "schedule": "wsd (warm-up, constant, linear decay to 0)",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None,
        "wall_s": round(wall_s, 1),
        "best_adamw": best_adamw.name,
        "best_adamw_final_val_loss": round(target, 4),
        "best_muon": best_muon.name,
        "runs": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "optimizers.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.out / "optimizers.png")
    for r in results:
        print(
            f"{r['name']:32s} final {r['final_val_loss']:.3f}  tokens to {target:.3f}: "
            f"{r['tokens_ratio_vs_best_adamw']}x  step {r['median_step_ms']} ms ({r['step_time_ratio_vs_best_adamw']}x)"
        )


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in report["runs"]:
        best = r["name"] in (report["best_adamw"], report["best_muon"])
        t, loss = zip(*r["curve"][1:])
        ax.plot(
            t,
            loss,
            label=r["name"],
            linewidth=2.2 if best else 0.9,
            color=("tab:blue" if r["optimizer"] == "adamw" else "tab:red"),
            alpha=1.0 if best else 0.45,
            linestyle="-" if best else "--",
        )
    ax.axhline(report["best_adamw_final_val_loss"], color="gray", linewidth=0.8, linestyle=":")
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss")
    s = report["shape"]
    ax.set_title(f"AdamW vs Muon: {s['n_layer']} layers x {s['n_embd']}, B={s['batch_size']}, T={s['block_size']}, WSD")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
