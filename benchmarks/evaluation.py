"""Harness loglikelihood speed: requests/s of ``GPTHarnessLM`` against lm-evaluation-harness's own
``hf`` model on the ``export --format hf`` folder of the same weights, on the same HellaSwag-shaped
requests at the same batch size, in one process, interleaved, medians; and the largest difference
between the two backends' per-request log-likelihoods.

The requests are HellaSwag's shape: each example a context of 50-90 tokens and 4 endings of 10-30,
cut from the packaged tiny Shakespeare (no network). Weights are random: speed does not depend on
them. The hf model computes the LM head and log-softmax at every position, each ending with its
context; ours runs each context once, its endings on top, the head only where a token is scored.
Both are set against the bound this machine puts on that least work: its FLOPs (``scoring_flops``)
over the matmul FLOP/s measured here in the run's dtype, before and after the timed passes.

    OMP_NUM_THREADS=1 python benchmarks/evaluation.py     # benchmarks/results/cpu-2core/evaluation.json and .md

``--simple_evaluate N`` times the whole of ``lm_eval.simple_evaluate`` instead (task building,
tokenizing, scoring, metrics): N HellaSwag-shaped examples as text in a local multiple-choice task
(``dataset_path: json``), GPT-2 124M in float32, each backend's model built once beforehand, both
interleaved, medians, and each request's log-likelihood compared. Writes
``evaluation_simple_evaluate.json`` beside ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from gpt_lightning.atomic import atomic_write_bytes
from gpt_lightning.data.corpus import Corpus
from gpt_lightning.data.tokenizer import gpt2_encoding
from gpt_lightning.evaluation.continuations import _groups, _trunk
from gpt_lightning.evaluation.harness_model import GPTHarnessLM
from gpt_lightning.interop.pretrained import export_hf
from gpt_lightning.model import GPT, GPTConfig
from gpt_lightning.observing.roofline import matmul_flops_per_sec


def scoring_flops(config: GPTConfig, requests: list[tuple[list[int], list[int]]]) -> float:
    """FLOPs of scoring ``requests`` with nothing run twice, padded or masked: torch's flop counter on a
    meta model gives a token's, a (token, position) pair's and a scored row's; the requests' shapes sum them."""

    def blocks(idx: torch.Tensor, pos: torch.Tensor, prefix=None, visible=None) -> tuple[float, list]:
        with FlopCounterMode(display=False) as counter:
            kv = []
            _trunk(model, model.embed(idx, pos), idx, pos, prefix, visible, kv)  # (1, T, C)
        return float(counter.get_total_flops()), kv

    with torch.device("meta"):
        model, one = GPT(config), torch.zeros(1, 1, dtype=torch.long)
        alone, kv = blocks(one, torch.tensor([0]))  # a token and one pair
        after = blocks(one, torch.tensor([1]), kv, torch.ones(1, 1, 1, 2, dtype=torch.bool))[0]  # and two pairs
        with FlopCounterMode(display=False) as counter:
            model.logits(torch.zeros(1, config.n_embd))  # (1, V)
    pair, head = after - alone, float(counter.get_total_flops())
    token = alone - pair
    total = 0.0
    for context, members in _groups(requests, config.block_size).items():
        P = len(context)
        total += P * token + P * (P + 1) / 2 * pair  # causal: position i sees i + 1
        for i in members:
            n = len(requests[i][1])  # scored rows; the blocks see all but the last token
            total += (n - 1) * (token + P * pair) + (n - 1) * n / 2 * pair + n * head
    return total


SHAPES = {
    "gpt2-124m": GPTConfig(),
    "tiny-cpu": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),  # configs/tiny-cpu.yaml's model
}
DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def hellaswag_shaped(examples: int, seed: int = 0) -> list[tuple[tuple[str, str], list[int], list[int]]]:
    """``examples`` x 4 requests (context tokens, ending tokens), the 4 of an example sharing the context."""
    tokens = gpt2_encoding().encode_ordinary(Corpus.tiny_shakespeare().open_text().read()[:200_000])
    rng = random.Random(seed)

    def span(lo: int, hi: int) -> list[int]:
        start, length = rng.randrange(len(tokens) - hi), rng.randint(lo, hi)
        return tokens[start : start + length]

    requests = []
    for _ in range(examples):
        context = span(50, 90)
        requests += [(("", ""), context, span(10, 30)) for _ in range(4)]
    return requests


def measure(config: GPTConfig, dtype: str, requests, batch_size: int, repeats: int) -> dict:
    from lm_eval.models.huggingface import HFLM

    torch.manual_seed(0)
    model = GPT(config).eval()
    with tempfile.TemporaryDirectory() as folder:
        export_hf(model, folder)
        hf = HFLM(
            pretrained=folder, batch_size=batch_size, device="cpu", dtype="float32", mixed_precision_dtype=DTYPES[dtype]
        )
    ours = GPTHarnessLM(model, batch_size=batch_size, device="cpu", dtype=DTYPES[dtype])
    backends = {"hf": hf, "ours": ours}
    matmul_dtype = DTYPES[dtype] or torch.float32
    peaks = [matmul_flops_per_sec("cpu", matmul_dtype)]  # again after the passes: the higher is the machine's
    seconds: dict[str, list[float]] = {name: [] for name in backends}
    answers = {}
    for repeat in range(repeats):
        for name in ("hf", "ours") if repeat % 2 == 0 else ("ours", "hf"):  # interleaved: load drifts hit both
            start = time.perf_counter()
            answers[name] = backends[name]._loglikelihood_tokens(requests, disable_tqdm=True)
            seconds[name].append(time.perf_counter() - start)
    peaks.append(matmul_flops_per_sec("cpu", matmul_dtype))
    median = {name: statistics.median(s) for name, s in seconds.items()}
    flops = scoring_flops(config, [(context, ending) for _, context, ending in requests])
    bound = len(requests) * max(peaks) / flops  # requests/s if the least work ran at the matmul peak
    precision = {}
    if (
        DTYPES[dtype] is not None
    ):  # how far each backend's answers are from float32's (the hf model's log-softmax runs in bf16)
        exact = GPTHarnessLM(model, batch_size=batch_size, device="cpu")._loglikelihood_tokens(requests)
        precision = {
            f"max_abs_difference_from_float32_{name}": max(abs(a[0] - b[0]) for a, b in zip(answers[name], exact))
            for name in backends
        }
    return {
        "requests": len(requests),
        "batch_size": batch_size,
        "seconds": seconds,
        "requests_per_s": {name: len(requests) / m for name, m in median.items()},
        "bound": {
            "requests_per_s": bound,
            "flops": flops,
            "matmul_dtype": str(matmul_dtype).removeprefix("torch."),
            "matmul_flops_per_sec": max(peaks),
            "matmul_probes": peaks,
        },
        "fraction_of_bound": {name: len(requests) / m / bound for name, m in median.items()},
        "speedup": median["hf"] / median["ours"],
        "max_abs_loglikelihood_difference": max(abs(a[0] - b[0]) for a, b in zip(answers["hf"], answers["ours"])),
        "greedy_flags_equal": [a[1] for a in answers["hf"]] == [b[1] for b in answers["ours"]],
        **precision,
    }


def through_harness(examples: int, batch_size: int, repeats: int) -> dict:
    """Seconds of the whole ``simple_evaluate`` (task building, tokenizing, scoring, metrics) for ours and
    the ``hf`` model on ``examples`` HellaSwag-shaped examples as a local task; GPT-2 124M, float32."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    decode = gpt2_encoding().decode
    rng = random.Random(0)
    requests = hellaswag_shaped(examples)
    docs = [
        {
            "ctx": decode(requests[i][1]),
            "endings": [decode(r[2]) for r in requests[i : i + 4]],
            "label": rng.randrange(4),
        }
        for i in range(0, len(requests), 4)
    ]
    torch.manual_seed(0)
    model = GPT(SHAPES["gpt2-124m"]).eval()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "data.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
        (root / "hs_shaped.yaml").write_text(
            f"task: hs_shaped\ndataset_path: json\ndataset_kwargs:\n  data_files: {root / 'data.jsonl'}\n"
            "test_split: train\noutput_type: multiple_choice\ndoc_to_text: '{{ctx}}'\n"
            "doc_to_choice: '{{endings}}'\ndoc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n"
            "    aggregation: mean\n    higher_is_better: true\n"
        )
        export_hf(model, root / "hf")
        tasks = TaskManager(include_path=str(root))
        # Both models built once, in memory, before any round: what is timed is the harness's work and theirs.
        backends = {
            "ours": GPTHarnessLM(model, batch_size=batch_size, device="cpu", dtype=torch.float32),
            "hf": HFLM(pretrained=str(root / "hf"), batch_size=batch_size, device="cpu", dtype="float32"),
        }
        seconds: dict[str, list[float]] = {name: [] for name in backends}
        accuracy, loglikelihoods = {}, {}
        for repeat in range(repeats + 1):  # the first round warms up (the dataset's cache, first calls): not timed
            for name in ("hf", "ours") if repeat % 2 == 0 else ("ours", "hf"):
                start = time.perf_counter()
                result = simple_evaluate(
                    model=backends[name],
                    tasks=["hs_shaped"],
                    task_manager=tasks,
                    batch_size=batch_size,
                    bootstrap_iters=0,
                    log_samples=True,
                )
                if repeat:
                    seconds[name].append(time.perf_counter() - start)
                accuracy[name] = result["results"]["hs_shaped"]["acc,none"]
                loglikelihoods[name] = [
                    answer[0] for sample in result["samples"]["hs_shaped"] for answer in sample["filtered_resps"]
                ]
    median = {name: statistics.median(s) for name, s in seconds.items()}
    return {
        "examples": examples,
        "batch_size": batch_size,
        "seconds": seconds,
        "median_seconds": median,
        "speedup": median["hf"] / median["ours"],
        "accuracy": accuracy,
        "accuracy_equal": accuracy["hf"] == accuracy["ours"],
        "max_abs_loglikelihood_difference": max(
            abs(a - b) for a, b in zip(loglikelihoods["hf"], loglikelihoods["ours"], strict=True)
        ),
    }


def difference(r: dict) -> str:
    if "max_abs_difference_from_float32_hf" in r:
        return f"hf {r['max_abs_difference_from_float32_hf']:.1e}, ours {r['max_abs_difference_from_float32_ours']:.1e}"
    return f"{r['max_abs_loglikelihood_difference']:.1e}"


def table(results: dict) -> str:
    rows = [
        "| model | dtype | requests | bound requests/s | hf requests/s (of bound) | ours requests/s (of bound) | ours / hf "
        "| max log-likelihood difference hf vs ours (bf16: each vs float32) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        shape, dtype = key.split("/")
        rate, of = r["requests_per_s"], r["fraction_of_bound"]
        rows.append(
            f"| {shape} | {dtype} | {r['requests']} | {r['bound']['requests_per_s']:.2f} | "
            f"{rate['hf']:.2f} ({of['hf']:.0%}) | {rate['ours']:.2f} ({of['ours']:.0%}) | **{r['speedup']:.2f}x** | "
            f"{difference(r)} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--runs",
        nargs="+",
        default=["gpt2-124m/float32:8", "tiny-cpu/float32:32", "tiny-cpu/bfloat16:32", "gpt2-124m/bfloat16:2"],
        help="shape/dtype:examples, each example 4 requests (default: %(default)s)",
    )
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per backend, alternating (median)")
    parser.add_argument("--out", default="benchmarks/results/cpu-2core/evaluation.json")
    parser.add_argument("--simple_evaluate", type=int, metavar="N", help="time the whole harness on N examples")
    args = parser.parse_args()
    if args.simple_evaluate:
        result = through_harness(args.simple_evaluate, args.batch_size, args.repeats)
        result["machine"] = {"processor": platform.processor(), "cpus": os.cpu_count(), "torch": torch.__version__}
        result["machine"] |= {"torch_threads": torch.get_num_threads(), "loadavg_at_end": os.getloadavg()}
        out = Path(args.out).with_name("evaluation_simple_evaluate.json")
        atomic_write_bytes(out, (json.dumps(result, indent=2) + "\n").encode())
        print(
            json.dumps(
                {k: result[k] for k in ("median_seconds", "speedup", "accuracy", "max_abs_loglikelihood_difference")}
            )
        )
        return
    results = {}
    for run in args.runs:
        key, examples = run.split(":")
        shape, dtype = key.split("/")
        results[key] = measure(SHAPES[shape], dtype, hellaswag_shaped(int(examples)), args.batch_size, args.repeats)
        print(
            key,
            json.dumps(
                {
                    k: results[key][k]
                    for k in ("requests_per_s", "fraction_of_bound", "speedup", "max_abs_loglikelihood_difference")
                }
                | {"bound_requests_per_s": results[key]["bound"]["requests_per_s"]}
            ),
            flush=True,
        )
    report = {
        "benchmark": "loglikelihood requests/s, GPTHarnessLM vs lm-eval's hf model, HellaSwag-shaped requests",
        "results": results,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "loadavg_at_end": os.getloadavg(),
        },
        "note": "2-core CPU shared with other jobs (see loadavg): ratios are measured side by side, interleaved",
    }
    atomic_write_bytes(Path(args.out), (json.dumps(report, indent=2) + "\n").encode())
    atomic_write_bytes(
        Path(args.out).with_suffix(".md"), (table(results) + "\n").encode()
    )  # the table docs/evaluation.md quotes
    print(table(results))


if __name__ == "__main__":
    main()
