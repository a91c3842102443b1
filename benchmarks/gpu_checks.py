"""The GPU path's checks that only a GPU can settle (issue 35), at one shape, into one JSON file:

1. accumulation: ``data.tokens_per_step`` of ``--micro_batches`` micro-batches under eager and each
   compile mode; each mode's per-step losses against eager's (bf16 tolerance), or the one-line
   refusal of the CUDA-graph modes ("reduce-overhead", "max-autotune") on CUDA;
2. quiet steps: ``--quiet_steps`` training steps with ``torch.cuda.set_sync_debug_mode("error")``
   (no logging step among them): zero host syncs, or the error of the first;
3. memory: the peak CUDA memory of a few steps with Muon against AdamW;
4. sampling, on the device named (the model moved there and its parameters checked: after
   ``trainer.fit`` Lightning leaves it on the CPU): from a tiny Shakespeare prompt, the trained
   model's next-token log-probabilities at every position of a text window in bf16 autocast against
   float32 (largest difference, top-1 agreement), greedy tokens of each, and each one's tokens/s.

``--accelerator cpu`` runs on the CPU (``gpu_run.sh --dry-run``, tiny shapes: CUDA-only figures are
None); any other refuses to start without CUDA, so no figure of a GPU check is a CPU's.

    python benchmarks/gpu_checks.py --n_layer 12 --n_head 12 --n_embd 768 --batch_size 4 --block_size 1024 \\
        --out benchmarks/results/<device>/gpu_checks.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer

from gpt_lightning.data.corpus import Corpus
from gpt_lightning.data.datamodule import TokenStreamDataModule
from gpt_lightning.data.tokenizer import gpt2_encoding
from gpt_lightning.errors import UserError
from gpt_lightning.generation import generate
from gpt_lightning.training.module import GPTLightningModule

BF16_TOLERANCE = 0.05  # |loss - eager's| a few steps in, bf16-mixed: rounding, not a wrong gradient
MODES = ["eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune"]


class StepLosses(Callback):
    """``train/loss`` after each optimizer step (logged every step)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0 and "train/loss" in trainer.callback_metrics:
            self.losses.append(float(trainer.callback_metrics["train/loss"]))


class QuietSteps(Callback):
    """CUDA's sync-debug mode "error" from the second optimizer step on, for ``steps`` optimizer steps
    (none of them logged): any host sync raises."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        first, end = (
            trainer.accumulate_grad_batches,
            trainer.accumulate_grad_batches * (1 + self.steps),
        )  # micro-batches
        if pl_module.device.type == "cuda" and batch_idx in (first, end):
            torch.cuda.set_sync_debug_mode("error" if batch_idx == first else "default")

    def on_train_end(self, trainer, pl_module) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")


def fit(args, callbacks, steps: int, log_every: int, **model) -> GPTLightningModule:
    torch.manual_seed(0)
    model.setdefault("compile", False)
    shape = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
    module = GPTLightningModule(**shape, val_sample_tokens=0, **model)
    data = TokenStreamDataModule(
        None,
        batch_size=args.batch_size,
        block_size=args.block_size,
        val_fraction=0.1,
        tokens_per_step=args.tokens_per_step,
    )
    trainer = Trainer(
        accelerator=args.accelerator,
        devices=[args.device.index] if args.device.index is not None else 1,
        precision="bf16-mixed",
        max_steps=steps,
        log_every_n_steps=log_every,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(module, data)
    return module


def accumulation(args) -> tuple[dict, GPTLightningModule | None]:
    results, eager, trained = {}, None, None
    for mode in args.modes:
        losses = StepLosses()
        compiled = {} if mode == "eager" else {"compile": True, "compile_mode": None if mode == "default" else mode}
        torch._dynamo.reset()
        try:
            module = fit(args, [losses], args.steps, 1, **compiled)
        except UserError as error:  # the CUDA-graph modes under accumulation, on CUDA
            results[mode] = {"refused": str(error)}
            continue
        if mode == "eager":
            eager, trained = losses.losses, module
        diff = max((abs(a - b) for a, b in zip(losses.losses, eager or [])), default=None)
        results[mode] = {
            "losses": losses.losses,
            "max_diff_vs_eager": diff,
            "ok": diff is None or diff <= BF16_TOLERANCE,
        }
    return results, trained


def quiet_steps(args) -> dict:
    try:
        fit(args, [QuietSteps(args.quiet_steps)], args.quiet_steps + 2, 10_000)
    except RuntimeError as error:
        return {"steps": args.quiet_steps, "host_syncs": "at least 1", "error": str(error).splitlines()[0]}
    return {"steps": args.quiet_steps, "host_syncs": 0 if args.device.type == "cuda" else None}


def peak_memory(args) -> dict:
    peaks = {}
    for optimizer in ("adamw", "muon"):
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        fit(args, [], 3, 10_000, optimizer=optimizer)
        peaks[optimizer] = torch.cuda.max_memory_allocated(args.device) / 2**30 if args.device.type == "cuda" else None
    ratio = peaks["muon"] / peaks["adamw"] if peaks["adamw"] else None
    return {"peak_gib": peaks, "muon_vs_adamw": ratio}


def check_device(args) -> torch.device:
    """The device every check runs on: the CPU only when ``--accelerator cpu`` says so."""
    if args.accelerator == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(
            f"--accelerator {args.accelerator}: no CUDA device here; --accelerator cpu for a CPU rehearsal"
        )
    return torch.device("cuda", torch.cuda.current_device())


def on_device(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` moved to ``device``, or the run stops: a figure measured elsewhere would be published as this device's."""
    model.to(device)
    elsewhere = {str(p.device) for p in model.parameters() if p.device != device}
    if elsewhere:
        raise SystemExit(f"the model's parameters are on {sorted(elsewhere)}, not {device}: nothing measured")
    return model


def sampling(model: torch.nn.Module, device: torch.device, args) -> dict:
    model = on_device(model, device).eval()
    text = gpt2_encoding().encode_ordinary(Corpus.tiny_shakespeare().open_text().read()[:20_000])
    window = torch.tensor(text[: args.block_size + 1], device=device)[None]  # (1, block_size + 1)
    prompt = window[:, : min(16, args.block_size // 2)]  # (1, P): the play's opening words
    new_tokens = min(args.sample_tokens, args.block_size - prompt.size(1))
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    out, logprobs = {}, {}
    for name, autocast in (("float32", False), ("bfloat16", True)):
        with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=autocast):
            logits, _ = model(window[:, :-1])  # (1, block_size, V): every position's next token, teacher-forced
            logprobs[name] = torch.log_softmax(logits[0].float(), dim=-1)  # (block_size, V)
            generate(model, prompt, 4, temperature=0)  # warm-up
            sync()
            start = time.perf_counter()
            tokens = generate(model, prompt, new_tokens, temperature=0)
            sync()
        out[name] = {
            "tokens_per_sec": new_tokens / (time.perf_counter() - start),
            "tokens": tokens[0, prompt.size(1) :].tolist(),
        }
    same = [a == b for a, b in zip(out["float32"]["tokens"], out["bfloat16"]["tokens"])]
    first_diff = same.index(False) if False in same else None
    diff = (logprobs["bfloat16"] - logprobs["float32"]).abs()  # (block_size, V)
    top1 = (logprobs["bfloat16"].argmax(-1) == logprobs["float32"].argmax(-1)).float().mean()
    return {
        "device": str(device),
        "prompt_tokens": prompt[0].tolist(),
        **out,
        "greedy_tokens_equal": all(same),
        "first_different_position": first_diff,
        "distinct_greedy_tokens": len(set(out["float32"]["tokens"])),
        "teacher_forced": {
            "positions": logprobs["float32"].size(0),
            "max_abs_logprob_diff": float(diff.max()),
            "mean_abs_logprob_diff": float(diff.mean()),
            "top1_agreement": float(top1),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (
        ("n_layer", 12),
        ("n_head", 12),
        ("n_embd", 768),
        ("batch_size", 4),
        ("block_size", 1024),
        ("micro_batches", 8),
        ("steps", 3),
        ("quiet_steps", 20),
        ("sample_tokens", 64),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    parser.add_argument("--accelerator", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    args.tokens_per_step = args.batch_size * args.block_size * args.micro_batches
    device = args.device = check_device(args)
    results, trained = accumulation(args)
    sampled = sampling(trained.model, device, args) if trained is not None else None
    del trained  # not resident while the optimizers' peaks are measured
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = {
        "device": name,
        "shape": {k: v for k, v in vars(args).items() if k != "device"},
        "accumulation": results,
        "quiet_steps": quiet_steps(args),
        "memory": peak_memory(args),
        "sampling": sampled,
    }
    Path(args.out).write_text(json.dumps(report, indent=1))
    for mode, result in results.items():
        print(
            f"accumulation {mode}: "
            + (
                f"refused: {result['refused']}"
                if "refused" in result
                else f"max |dloss| vs eager {result['max_diff_vs_eager']}"
            )
        )
    print(f"quiet steps: {report['quiet_steps']}")
    print(f"peak memory: {report['memory']}")
    if report["sampling"]:
        s = report["sampling"]
        print(
            f"sampling on {s['device']}: greedy bf16 == float32: {s['greedy_tokens_equal']} "
            f"(first difference at {s['first_different_position']}), teacher-forced {s['teacher_forced']}, "
            f"tokens/s float32 {s['float32']['tokens_per_sec']:.0f}, bf16 {s['bfloat16']['tokens_per_sec']:.0f}"
        )
    failed = [mode for mode, r in results.items() if not r.get("ok", True)] + (
        ["quiet_steps"] if "error" in report["quiet_steps"] else []
    )
    if failed:
        raise SystemExit(f"FAIL: {', '.join(failed)} (see {args.out})")


if __name__ == "__main__":
    main()
