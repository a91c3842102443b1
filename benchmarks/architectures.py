"""Tokens to a given loss: GPT-2 against the modern GPT (docs/modern.md), switch by switch, in lockstep.

Every run is this package's ``GPT`` with its optimizer as ``GPTLightningModule`` builds it
(``build_optimizer``: AdamW, or Muon on the blocks' matrices with AdamW on the rest, the untied
embedding and head at rates of their own), on the same data, windows, seed, token budget and WSD
schedule, one step each in turn (``lockstep.py``, as ``optimizers.py`` runs its optimizers). The runs:

- GPT-2 with AdamW, its learning rate swept (``--gpt2_adamw_lrs``);
- GPT-2 with Muon: Muon's rate and the AdamW part's (the tied embedding, norms, biases) varied one at a time;
- the modern GPT (every switch ``configs/modern-tiny-cpu.yaml`` sets) with AdamW, swept;
- the modern GPT with Muon: Muon's, the embedding's and the head's rates varied one at a time
  around the preset's (the embedding's and head's are the groups an untied head adds);
- GPT-2 with Muon plus one switch at a time: each of ``MODERN_SWITCHES`` (and ``bias``) the preset
  sets, at the preset's value; an untied head at the preset's embedding and head rates.

With ``--seeds 0 1`` the best run of each of the four headline groups (by final validation loss at
the first seed) runs again at each further seed, in a lockstep of its own (other initial weights
and windows). For each run: the final validation loss, the tokens it needed to reach the best
GPT-2 + AdamW run's and the best GPT-2 + Muon run's final validation loss (same seed, interpolated
between evaluations; as a fraction of the budget), and its median eager time per step. Writes
``architectures.json`` and ``architectures.png`` to ``--out``. ``--groups`` trains some kinds of run
only, and ``--merge`` makes one report of several such runs at one shape (each its own lockstep: on a
shared machine, separate processes side by side get more of it; docs/modern.md was made so).

``--time_compiled`` measures instead the time per step of a few runs (``--timed``: GPT-2 + Muon,
with the softcap, with the untied head, the modern GPT + Muon), eager and compiled
(``torch.compile`` of the whole model, as the CPU presets compile), in rotation: ``architectures_step_time.json``.

    OMP_NUM_THREADS=1 python benchmarks/architectures.py --seeds 0 1   # benchmarks/results/cpu-2core/
    OMP_NUM_THREADS=1 python benchmarks/architectures.py --time_compiled
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lockstep
import torch
import yaml

from gpt_lightning.config import MODERN_SWITCHES, GPTConfig
from gpt_lightning.model import GPT
from gpt_lightning.training.compilation import compile_in_place
from gpt_lightning.training.optimizers import build_optimizer

REPO = Path(__file__).resolve().parents[1]
# The architecture options a switch row turns on one at a time: the modern switches, and biases off.
SWITCHES = (*MODERN_SWITCHES, "bias")
HEADLINE = ("gpt2 adamw", "gpt2 muon", "modern adamw", "modern muon")
GROUPS = (*HEADLINE, "switch")
TARGETS = ("gpt2 adamw", "gpt2 muon")  # the groups whose best final loss the others are measured against


def preset_model(preset: Path) -> dict:
    return yaml.safe_load((REPO / preset).read_text())["model"]


def modern_architecture(preset: Path) -> dict:
    """The switches the modern preset sets away from GPT-2's defaults, at the preset's values."""
    gpt2, model = GPTConfig(), preset_model(preset)
    return {name: model[name] for name in SWITCHES if name in model and model[name] != getattr(gpt2, name)}


@dataclass
class Arm:
    """One run's architecture (``GPTConfig`` fields away from GPT-2's) and optimizer settings."""

    name: str
    group: str
    optimizer: str
    learning_rate: float
    muon_learning_rate: float | None = None
    embedding_learning_rate: float | None = None
    head_learning_rate: float | None = None
    architecture: dict = field(default_factory=dict)


def arms(args: argparse.Namespace) -> list[Arm]:
    """Every run of the first seed, in the order of the module docstring."""
    modern = modern_architecture(args.preset)
    out = [Arm(f"gpt2 adamw lr={lr:g}", "gpt2 adamw", "adamw", lr) for lr in args.gpt2_adamw_lrs]

    def one_at_a_time(group: str, architecture: dict, base: dict, sweeps: dict) -> list[Arm]:
        """``base``, then each rate in ``sweeps`` changed to each of its other values, the rest at ``base``."""
        variants = [base] + [{**base, key: v} for key, values in sweeps.items() for v in values if v != base[key]]
        short = dict(
            learning_rate="adamw", muon_learning_rate="muon", embedding_learning_rate="emb", head_learning_rate="head"
        )
        return [
            Arm(
                f"{group} " + " ".join(f"{short[k]}={v:g}" for k, v in rates.items()),
                group,
                "muon",
                architecture=architecture,
                **rates,
            )
            for rates in variants
        ]

    gpt2_muon = dict(muon_learning_rate=args.gpt2_muon_lrs[0], learning_rate=args.gpt2_muon_adamw_lrs[0])
    out += one_at_a_time(
        "gpt2 muon", {}, gpt2_muon, dict(muon_learning_rate=args.gpt2_muon_lrs, learning_rate=args.gpt2_muon_adamw_lrs)
    )
    out += [
        Arm(f"modern adamw lr={lr:g}", "modern adamw", "adamw", lr, architecture=modern) for lr in args.modern_adamw_lrs
    ]
    rates = dict(
        muon_learning_rate=args.modern_muon_lrs[0],
        embedding_learning_rate=args.embedding_lrs[0],
        head_learning_rate=args.head_lrs[0],
    )
    out += one_at_a_time(
        "modern muon",
        modern,
        {**rates, "learning_rate": args.modern_adamw_part_lr},
        dict(
            muon_learning_rate=args.modern_muon_lrs,
            embedding_learning_rate=args.embedding_lrs,
            head_learning_rate=args.head_lrs,
        ),
    )
    for switch, value in modern.items():
        if args.switches is not None and switch not in args.switches:
            continue
        untied = (
            dict(
                embedding_learning_rate=rates["embedding_learning_rate"], head_learning_rate=rates["head_learning_rate"]
            )
            if switch == "tie_embeddings"
            else {}
        )
        out.append(
            Arm(f"gpt2 muon + {switch}={value}", "switch", "muon", **gpt2_muon, **untied, architecture={switch: value})
        )
    return [arm for arm in out if arm.group in args.groups]


def build(arm: Arm, args: argparse.Namespace, vocab: int, seed: int) -> lockstep.Run:
    """The arm's GPT and optimizer as ``GPTLightningModule.configure_optimizers`` builds them."""
    torch.manual_seed(seed)  # the same initial draws for every run of a seed
    config = GPTConfig(
        vocab_size=vocab,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=0.0,
        **arm.architecture,
    )
    model = GPT(config).to(args.device)
    optimizer = build_optimizer(
        model,
        arm.optimizer,
        learning_rate=arm.learning_rate,
        weight_decay=args.weight_decay,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=True,
        muon_learning_rate=arm.muon_learning_rate or 0.02,
        muon_momentum=0.95,
        muon_weight_decay=0.0,
        muon_adjust_lr="original",
        embedding_learning_rate=arm.embedding_learning_rate,
        head_learning_rate=arm.head_learning_rate,
    )
    return lockstep.Run(arm.name, model, optimizer, args)


def train_seed(chosen: list[Arm], args: argparse.Namespace, ids: torch.Tensor, vocab: int, seed: int) -> dict:
    """One lockstep of ``chosen`` at ``seed``: each run's settings, curve and median step time, the
    step time also as a multiple of this lockstep's GPT-2 + Muon base run's (the first of its group)."""
    runs = [build(arm, args, vocab, seed) for arm in chosen]
    wall_s = lockstep.train_in_lockstep(runs, lockstep.Data(ids, args, seed), args)
    reference = next((run for arm, run in zip(chosen, runs) if arm.group == "gpt2 muon"), None)
    rows = [
        {
            **asdict(arm),
            "seed": seed,
            "final_val_loss": round(run.curve[-1][1], 4),
            "median_step_ms": round(1000 * run.median_step_s(), 1),
            "step_time_vs_gpt2_muon_base": None
            if reference is None
            else round(run.median_step_s() / reference.median_step_s(), 3),
            "curve": [[t, round(loss, 4)] for t, loss in run.curve],
        }
        for arm, run in zip(chosen, runs)
    ]
    return {
        "seed": seed,
        "groups": sorted({arm.group for arm in chosen}),
        "wall_s": round(wall_s, 1),
        "loadavg": loadavg(),
        "runs": rows,
    }


def summarize(seed: int, rows: list[dict], budget: int) -> dict:
    """The runs of one seed (from one lockstep or several), each with the tokens it needed to reach
    the best GPT-2 + AdamW and the best GPT-2 + Muon run's final loss, as a fraction of the budget."""
    best = {
        group: min((r for r in rows if r["group"] == group), key=lambda r: r["final_val_loss"])
        for group in TARGETS
        if any(r["group"] == group for r in rows)
    }
    out = []
    for row in rows:
        row = {k: v for k, v in row.items() if not k.startswith("tokens_ratio_to_")}
        for group, target in best.items():
            reached = lockstep.tokens_to_reach(row["curve"], target["final_val_loss"])
            row[f"tokens_ratio_to_best_{group.replace(' ', '_')}"] = (
                None if reached is None else round(reached / budget, 3)
            )
        out.append(row)
    return {
        "seed": seed,
        "tokens_budget": budget,
        "best": {group: r["name"] for group, r in best.items()},
        "best_final_val_loss": {group: r["final_val_loss"] for group, r in best.items()},
        "runs": out,
    }


def assemble(meta: dict, passes: list[dict]) -> dict:
    """The report of one or more lockstep passes (``passes``: ``train_seed``'s): each seed's runs
    (a run in two passes counted once, the first), summarized, and the headline."""
    budget = meta["shape"]["steps"] * meta["shape"]["batch_size"] * meta["shape"]["block_size"]
    seeds = []
    for seed in dict.fromkeys(p["seed"] for p in passes):
        rows = {}
        for k, p in enumerate(passes):
            for row in p["runs"] if p["seed"] == seed else []:
                rows.setdefault(row["name"], {**row, "lockstep": k})
        seeds.append(summarize(seed, list(rows.values()), budget))
    return {
        **meta,
        "lockstep_passes": [{k: v for k, v in p.items() if k != "runs"} for p in passes],
        "seeds": seeds,
        "headline": headline(seeds),
    }


def merge(reports: list[dict]) -> dict:
    """One report of several runs of this script at the same shape (each its own lockstep, e.g. run
    side by side as separate processes to use more of a shared machine)."""
    meta = {k: v for k, v in reports[0].items() if k not in ("lockstep_passes", "seeds", "headline")}
    for other in reports[1:]:
        if {k: other[k] for k in meta if k not in ("preset",)} != {k: meta[k] for k in meta if k not in ("preset",)}:
            raise SystemExit(
                "--merge: the reports differ in shape, schedule or architecture; merge only runs of one setting"
            )
    passes = []
    for report in reports:
        for k, p in enumerate(report["lockstep_passes"]):
            runs = [
                row for s in report["seeds"] for row in s["runs"] if row["lockstep"] == k and row["seed"] == p["seed"]
            ]
            passes.append({**p, "runs": runs})
    return assemble(meta, passes)


def best_of_groups(rows: list[dict]) -> list[str]:
    """The name of each headline group's run with the lowest final validation loss."""
    return [
        min((r for r in rows if r["group"] == group), key=lambda r: r["final_val_loss"])["name"]
        for group in HEADLINE
        if any(r["group"] == group for r in rows)
    ]


def headline(seeds: list[dict]) -> dict:
    """The best run of each headline group at every seed, and the targets: the modern GPT + Muon's
    tokens to the best GPT-2 + Muon's final loss (target 0.8x) and to the best GPT-2 + AdamW's (0.5x)."""
    table = {}
    for name in best_of_groups(seeds[0]["runs"]):
        rows = [next((r for r in s["runs"] if r["name"] == name), {}) for s in seeds]  # {}: not run at that seed
        ratios = [key for key in rows[0] if key.startswith("tokens_ratio_to_")]
        table[rows[0]["group"]] = {
            "name": name,
            **{key: [r.get(key) for r in rows] for key in ("final_val_loss", *ratios, "median_step_ms")},
        }
    targets = {}
    for group, target in (("gpt2 muon", 0.8), ("gpt2 adamw", 0.5)):
        key = f"tokens_ratio_to_best_{group.replace(' ', '_')}"
        if "modern muon" in table and key in table["modern muon"]:
            targets[f"modern_muon_{key.removeprefix('tokens_ratio_')}"] = {
                "target": target,
                "measured": table["modern muon"][key],
            }
    return {"rows": table, "targets": targets}


def time_compiled(args: argparse.Namespace, vocab: int) -> dict:
    """The median time per step of the ``--timed`` runs, eager and compiled, stepped in rotation on
    the same batch (after ``--compile_warmup`` steps each: compilation and the allocator's warm-up)."""
    every = arms(args)
    chosen = {arm.name: arm for arm in every}
    if args.timed is None:
        args.timed = [
            next(a.name for a in every if a.group == "gpt2 muon"),
            *(
                a.name
                for a in every
                if a.group == "switch" and set(a.architecture) & {"logit_softcap", "tie_embeddings"}
            ),
            next(a.name for a in every if a.group == "modern muon"),
        ]
    missing = [name for name in args.timed if name not in chosen]
    if missing:
        raise SystemExit(f"--timed {missing[0]!r} is no run of this benchmark; its runs: {', '.join(chosen)}")
    runs = []
    for name in args.timed:
        for compiled in (False, True):
            run = build(chosen[name], args, vocab, args.seed)
            if compiled:
                compile_in_place(run.model, "model", dynamic=False)
            runs.append((name, compiled, run))
    x = torch.randint(0, vocab, (args.batch_size, args.block_size), device=args.device)
    compile_s = {}
    for name, compiled, run in runs:
        start = time.perf_counter()
        for step in range(args.compile_warmup):
            run.step(x, x, step)
        compile_s[(name, compiled)] = time.perf_counter() - start
        run.step_seconds.clear()
    cpu_seconds = {(name, compiled): [] for name, compiled, _ in runs}
    for step in range(args.timed_steps):
        for k in range(len(runs)):
            name, compiled, run = runs[(step + k) % len(runs)]
            start = time.process_time()  # this process's CPU time: what a loaded machine's waits leave out
            run.step(x, x, step)
            cpu_seconds[(name, compiled)].append(time.process_time() - start)
    wall = {(name, compiled): 1000 * statistics.median(run.step_seconds) for name, compiled, run in runs}
    cpu = {key: 1000 * statistics.median(seconds) for key, seconds in cpu_seconds.items()}
    base = args.timed[0]
    rows = []
    for name in args.timed:
        row = {"name": name, "warmup_s_compiled": round(compile_s[(name, True)], 1)}
        for mode, compiled in (("eager", False), ("compiled", True)):
            row |= {
                f"{mode}_ms": round(wall[(name, compiled)], 1),
                f"{mode}_cpu_ms": round(cpu[(name, compiled)], 1),
                f"{mode}_vs_first": round(wall[(name, compiled)] / wall[(base, compiled)], 3),
                f"{mode}_cpu_vs_first": round(cpu[(name, compiled)] / cpu[(base, compiled)], 3),
            }
        rows.append(row)
    return {
        "what": "median time per training step (forward, backward, clipping, optimizer step), eager and "
        "torch.compile'd whole model, stepped in rotation: wall time (_ms) and this process's CPU time "
        "(_cpu_ms) (benchmarks/architectures.py --time_compiled)",
        "shape": {k: getattr(args, k) for k in ("device", "n_layer", "n_head", "n_embd", "batch_size", "block_size")},
        "vocab_size": vocab,
        "steps_timed": args.timed_steps,
        "warmup_steps_each": args.compile_warmup,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "loadavg": loadavg(),
        "runs": rows,
    }


def loadavg() -> list[str] | None:
    path = Path("/proc/loadavg")
    return path.read_text().split()[:3] if path.exists() else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--preset",
        type=Path,
        default=Path("configs/modern-tiny-cpu.yaml"),
        help="the modern GPT's switches and (the defaults of) its Muon, embedding and head rates",
    )
    model = preset_model(parser.parse_known_args()[0].preset)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu-2core"))
    lockstep.add_arguments(parser, n_embd=128, steps=100, warmup_steps=5, eval_every=10)
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=[0], help="the first: every run; the others: the headline rows"
    )
    parser.add_argument("--weight_decay", type=float, default=0.0, help="AdamW's, on the 2-D weights it trains")
    parser.add_argument("--gpt2_adamw_lrs", type=float, nargs="+", default=[1.5e-3, 3e-3, 6e-3])
    parser.add_argument("--gpt2_muon_lrs", type=float, nargs="+", default=[0.02, 0.04], help="the first is the base")
    parser.add_argument(
        "--gpt2_muon_adamw_lrs",
        type=float,
        nargs="+",
        default=[3e-3, 1e-2],
        help="GPT-2 + Muon's AdamW part (tied embedding and head, norms, biases); the first is the base",
    )
    parser.add_argument("--modern_adamw_lrs", type=float, nargs="+", default=[3e-3, 6e-3, 1.2e-2])
    parser.add_argument(
        "--modern_muon_lrs",
        type=float,
        nargs="+",
        default=[model["muon_learning_rate"], 0.04],
        help="the first is the base (the preset's)",
    )
    parser.add_argument(
        "--embedding_lrs",
        type=float,
        nargs="+",
        default=[model["embedding_learning_rate"], 0.03, 0.3],
        help="the untied embedding's AdamW rate under Muon; the first is the base (the preset's)",
    )
    parser.add_argument(
        "--head_lrs",
        type=float,
        nargs="+",
        default=[model["head_learning_rate"], 0.002, 0.01],
        help="the untied head's AdamW rate under Muon; the first is the base (the preset's)",
    )
    parser.add_argument(
        "--modern_adamw_part_lr",
        type=float,
        default=model["learning_rate"],
        help="the modern GPT + Muon's other AdamW weights (none with its parameter-free norms, no biases)",
    )
    parser.add_argument("--groups", nargs="+", choices=GROUPS, default=list(GROUPS), help="the kinds of run to train")
    parser.add_argument(
        "--switches", nargs="+", default=None, help="the switch rows to run (default: every one the preset sets)"
    )
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="merge these architectures.json (runs of this script at one shape) into --out's",
    )
    parser.add_argument(
        "--time_compiled", action="store_true", help="time eager and compiled steps only: architectures_step_time.json"
    )
    parser.add_argument(
        "--timed",
        nargs="+",
        default=None,
        help="the runs to time (default: GPT-2 + Muon, with the softcap, with the untied head, modern + Muon)",
    )
    parser.add_argument("--timed_steps", type=int, default=20)
    parser.add_argument("--compile_warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_float32_matmul_precision("high")
    compact = args.compact_vocab if args.compact_vocab is not None else args.device == "cpu"
    ids, vocab = lockstep.tokens(compact)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.time_compiled:
        report = time_compiled(args, vocab)
        (args.out / "architectures_step_time.json").write_text(json.dumps(report, indent=1) + "\n")
        for r in report["runs"]:
            print(
                f"{r['name']:56s} eager {r['eager_ms']:7.1f} ms, CPU {r['eager_cpu_ms']:7.1f} ms ({r['eager_cpu_vs_first']}x)  "
                f"compiled {r['compiled_ms']:7.1f} ms, CPU {r['compiled_cpu_ms']:7.1f} ms ({r['compiled_cpu_vs_first']}x)"
            )
        return

    meta = {
        "what": "validation loss against tokens: GPT-2 vs the modern GPT, AdamW and Muon, one switch at a time "
        "(benchmarks/architectures.py, lockstep)",
        "shape": {k: getattr(args, k) for k in lockstep.SHAPE},
        "weight_decay": args.weight_decay,
        "vocab_size": vocab,
        "compact_vocab": compact,
        "schedule": "wsd (warm-up, constant, linear decay to 0)",
        "modern": modern_architecture(args.preset),
        "preset": str(args.preset),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    if args.merge:
        report = merge([json.loads(path.read_text()) for path in args.merge])
    else:
        every, passes = arms(args), []
        for k, seed in enumerate(args.seeds):
            chosen = every if k == 0 else [arm for arm in every if arm.name in best_of_groups(passes[0]["runs"])]
            passes.append(train_seed(chosen, args, ids, vocab, seed))
            report = assemble(meta, passes)
            (args.out / "architectures.json").write_text(json.dumps(report, indent=1) + "\n")  # after every seed
    (args.out / "architectures.json").write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.out / "architectures.png")
    first = report["seeds"][0]
    for r in first["runs"]:
        print(
            f"{r['name']:56s} final {r['final_val_loss']:.3f}  to gpt2 adamw {r.get('tokens_ratio_to_best_gpt2_adamw')}x  "
            f"to gpt2 muon {r.get('tokens_ratio_to_best_gpt2_muon')}x  step {r['median_step_ms']} ms"
        )
    print(json.dumps(report["headline"]["targets"]))


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = report["seeds"][0]
    best = set(best_of_groups(first["runs"]))
    colors = {"gpt2 adamw": "tab:blue", "gpt2 muon": "tab:red", "modern adamw": "tab:cyan", "modern muon": "tab:purple"}
    switches = any(r["group"] == "switch" for r in first["runs"])
    fig, axes = plt.subplots(1, 2 if switches else 1, figsize=(13 if switches else 7, 5), sharey=True, squeeze=False)
    left, right = axes[0][0], axes[0][-1]
    for r in first["runs"]:
        t, loss = zip(*r["curve"][1:])
        if r["group"] == "switch":
            right.plot(t, loss, label=r["name"].removeprefix("gpt2 muon + "), linewidth=1.0)
        else:
            on = r["name"] in best
            left.plot(
                t,
                loss,
                label=r["name"],
                color=colors[r["group"]],
                linewidth=2.2 if on else 0.8,
                alpha=1.0 if on else 0.45,
                linestyle="-" if on else "--",
            )
    base = next((r for r in first["runs"] if r["group"] == "gpt2 muon"), None)  # the rates the switch rows run at
    if switches and base is not None:
        t, loss = zip(*base["curve"][1:])
        right.plot(t, loss, label=f"{base['name']} (no switch: their base)", color="black", linewidth=2.0)
    panels = [(left, "GPT-2 vs modern, AdamW and Muon (rate sweeps)")] + [
        (right, "GPT-2 + Muon, one switch at a time")
    ] * switches
    for ax, title in panels:
        for group, loss in first["best_final_val_loss"].items():  # the targets
            ax.axhline(loss, color="gray", linewidth=0.8, linestyle=":" if group == "gpt2 adamw" else "-.")
        ax.set_xlabel("training tokens")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=6)
    left.set_ylabel("validation loss")
    lo = min(min(loss for _, loss in r["curve"]) for r in first["runs"])
    left.set_ylim(lo - 0.1, lo + 2.0)
    s = report["shape"]
    fig.suptitle(
        f"{s['n_layer']} layers x {s['n_embd']}, B={s['batch_size']}, T={s['block_size']}, "
        f"{s['steps']} steps, WSD, seed {first['seed']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
