"""HellaSwag scoring speed: examples/s of ``gpt_lightning.interop.hellaswag.evaluate`` at several batch sizes
against the scorer it replaced (one example, 4 rows, per forward pass, logits at every position, one
read back per example), on the same weights and examples, in one process, interleaved, medians.

No network: the examples are HellaSwag-shaped (a context, 4 endings, a label) cut from the packaged
tiny Shakespeare, written to a local JSONL (or ``--data_file`` gives the real one). The weights are
a random GPT-2 124M by default: speed does not depend on them. Results go to a JSON file.

    python benchmarks/hellaswag.py                       # GPT-2 124M, 64 examples, batch 1 and 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gpt_lightning.atomic import atomic_write_bytes
from gpt_lightning.data.corpus import Corpus
from gpt_lightning.data.tokenizer import gpt2_encoding
from gpt_lightning.interop.hellaswag import evaluate, read_examples, render
from gpt_lightning.model import GPT, GPTConfig


def write_examples(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` HellaSwag-shaped examples from tiny Shakespeare: a context of 20-60 words and 4 endings
    of 8-30 words (HellaSwag's are about 40 and 20 tokens)."""
    words = Corpus.tiny_shakespeare().open_text().read().split()
    rng = random.Random(seed)

    def span(lo: int, hi: int) -> str:
        start, length = rng.randrange(len(words) - hi), rng.randint(lo, hi)
        return " ".join(words[start : start + length])

    lines = [
        json.dumps({"ctx": span(20, 60), "endings": [span(8, 30) for _ in range(4)], "label": rng.randrange(4)})
        for _ in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


@torch.no_grad()
def per_example_scorer(model: GPT, examples, encode, device: torch.device) -> dict:
    """The scorer before batching (as of commit 57dc262), kept as the baseline: one example per
    forward pass, cross-entropy at every position, the answer read back for each example."""
    n = correct_norm = correct = 0
    for example in examples:
        tokens, mask = render(example, encode)
        tokens, mask = tokens[:, -model.config.block_size :].to(device), mask[:, -model.config.block_size :].to(device)
        logits, _ = model(tokens)  # (4, L, V)
        losses = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten(), reduction="none").view(
            4, -1
        )
        ending = mask[:, 1:].float()
        summed = (losses * ending).sum(dim=1)
        by_mean, by_sum = torch.stack(((summed / ending.sum(dim=1)).argmin(), summed.argmin())).tolist()
        correct_norm += by_mean == example.label
        correct += by_sum == example.label
        n += 1
    return {"acc_norm": correct_norm / n, "acc": correct / n, "examples": n}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n_layer", type=int, default=12)
    parser.add_argument("--n_head", type=int, default=12)
    parser.add_argument("--n_embd", type=int, default=768)
    parser.add_argument("--examples", type=int, default=64, help="synthetic examples to score")
    parser.add_argument("--data_file", help="score a real hellaswag_val.jsonl instead (its first --examples)")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3, help="timed passes of each; the median is reported")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default="benchmarks/results/cpu-2core/hellaswag.json")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)).to(device).eval()
    encode = gpt2_encoding().encode_ordinary
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.data_file) if args.data_file else write_examples(Path(tmp) / "val.jsonl", args.examples)
        examples = list(read_examples(path))[: args.examples]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    contenders = {"per_example_before": lambda chosen: per_example_scorer(model, chosen, encode, device)}
    # The batched scorer as `eval --task hellaswag` runs it by default: bf16 autocast on a GPU.
    bf16 = (lambda: torch.autocast("cuda", torch.bfloat16)) if device.type == "cuda" else contextlib.nullcontext
    for b in args.batch_sizes:
        contenders[f"batched_{b}"] = lambda chosen, b=b: evaluate(
            model, iter(chosen), encode, device, batch_size=b, autocast=bf16
        )
    for fn in contenders.values():  # warm-up, not timed
        fn(examples[: max(args.batch_sizes)])
    times: dict[str, list[float]] = {name: [] for name in contenders}
    results = {}
    for _ in range(args.repeats):
        for name, fn in contenders.items():
            sync()
            start = time.perf_counter()
            results[name] = fn(examples)
            sync()
            times[name].append(time.perf_counter() - start)
    before = len(examples) / statistics.median(times["per_example_before"])
    rows = {}
    for name, seconds in times.items():
        rate = len(examples) / statistics.median(seconds)
        rows[name] = {"examples_per_sec": rate, "vs_before": rate / before, "seconds": seconds, "result": results[name]}
        print(f"{name:>20}: {rate:7.2f} examples/s ({rate / before:.2f}x before); {results[name]}", flush=True)
    # On CUDA the batched scorer runs under bf16 autocast, so its answers may differ from fp32's there.
    same = all(r == results["per_example_before"] for r in results.values())
    print(f"same answers as before: {same}")
    report = {
        "benchmark": "hellaswag",
        "model": {"n_layer": args.n_layer, "n_head": args.n_head, "n_embd": args.n_embd},
        "examples": len(examples),
        "data": args.data_file or "synthetic (tiny Shakespeare)",
        "repeats": args.repeats,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "same_answers_as_before": same,
        "results": rows,
    }
    atomic_write_bytes(Path(args.out), (json.dumps(report, indent=2) + "\n").encode())
    print(f"written to {args.out}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
