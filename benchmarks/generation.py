"""Generation speed: tokens/s of ``gpt_lightning.generation.generate`` (KV cache) against ``transformers``'
``GPT2LMHeadModel.generate`` (``use_cache=True``) on the same weights, and against our uncached path
(a full forward pass per token, the path before the cache), side by side in one process.

The weights are a random GPT-2 124M (no hub needed), exported with ``export_hf`` and loaded by
``transformers``. Every run is greedy from the same tiny Shakespeare prompt (a row per batch entry),
so the outputs are compared too. Runs are interleaved (ours, theirs, ours, ...) and each figure is
the median over ``--repeats``, timed between CUDA synchronizations, so a busy machine slows all
alike. The compiled step is warmed by a short run of the same cache length (a longer prompt, a few
tokens). Each rate is printed beside the bound this machine sets on it, a roofline (``run_cost``), and
the fraction reached. Results go to a JSON file, rewritten after each batch size.

    python benchmarks/generation.py                     # GPT-2 124M, batch 1 and 8, 256 new tokens
    python benchmarks/generation.py --compile --dtype bfloat16 --transformers_static   # the GPU run's
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from gpt_lightning.atomic import atomic_write_bytes
from gpt_lightning.data.corpus import Corpus
from gpt_lightning.data.tokenizer import gpt2_encoding
from gpt_lightning.generation import generate
from gpt_lightning.interop.pretrained import export_hf
from gpt_lightning.model import GPT, GPTConfig, KVCache
from gpt_lightning.observing.roofline import _median_seconds, matmul_flops_per_sec


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[float, torch.Tensor]:
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - start, out


def run_cost(config: GPTConfig, batch: int, prompt_tokens: int, new_tokens: int, dtype: torch.dtype) -> dict:
    """The least a timed run does: ``passes``, one per forward pass (the prefill, then each decode step),
    its FLOPs (torch's flop counter on a meta copy: the prefill, and a decode step at two lengths, its
    FLOPs being affine in the positions it attends to) and the bytes it reads (every weight, the
    position table's unread rows left out, and a decode step's cached keys and values). A run past
    ``block_size`` slides its window and fills it again: that is not counted (less work, a bound still)."""
    with torch.device("meta"):
        model = GPT(config).to(dtype)
    wpe = getattr(model.transformer, "wpe", None)
    weights = sum(p.nbytes for p in model.parameters() if p is not getattr(wpe, "weight", None))
    row = wpe.weight[0].nbytes if wpe is not None else 0  # a position's row: read once per token
    cap = config.block_size
    caches = [KVCache(min(cap, prompt_tokens + new_tokens)) for _ in model.transformer.h]
    idx = torch.zeros(batch, prompt_tokens, dtype=torch.long, device="meta")

    def counted(*args) -> float:
        with FlopCounterMode(display=False) as counter:
            model.forward_cached(*args)
        return float(counter.get_total_flops())

    prefill = counted(idx, caches, torch.arange(prompt_tokens, device="meta"))
    passes = [{"flops": prefill, "bytes": weights + prompt_tokens * row}]
    kv_per_position = sum(c.k.nbytes + c.v.nbytes for c in caches) / caches[0].max_len  # all layers, the batch
    first, second = (min(cap, prompt_tokens + i) for i in (1, 2))  # positions attended by the first two steps
    at = {
        length: counted(idx[:, :1], caches, torch.tensor([length - 1], device="meta"), length)
        for length in {first, second}
    }
    slope = (at[second] - at[first]) / (second - first) if second != first else 0.0
    for step in range(1, new_tokens):  # the first new token comes from the prefill
        length = min(cap, prompt_tokens + step)
        passes.append(
            {"flops": at[first] + slope * (length - first), "bytes": weights + row + kv_per_position * length}
        )
    return {"weight_bytes": weights, "passes": passes}


# The matrix streamed by the bandwidth probe: far above any CPU's L3 or GPU's L2.
READ_BYTES = 512 * 2**20


def read_bytes_per_sec(
    device: torch.device | str, dtype: torch.dtype, nbytes: int = READ_BYTES, repeats: int = 5
) -> float:
    """Bytes/s ``device`` streams from memory into a matrix-vector product of ``dtype`` (the best of
    three), which bounds decoding at small batch."""
    device = torch.device(device)
    cols = 1024
    rows = max(1, nbytes // (cols * torch.finfo(dtype).bits // 8))
    matrix = torch.ones(rows, cols, device=device, dtype=dtype)  # written: no shared zero pages to read
    vector = torch.ones(cols, device=device, dtype=dtype)
    probes = (matrix.sum, lambda: torch.mv(matrix, vector), lambda: torch.nn.functional.linear(vector[None], matrix))
    return max(matrix.nbytes / _median_seconds(probe, device, repeats) for probe in probes)


def roofline(passes: list[dict], flops_per_sec: float, bytes_per_sec: float) -> dict:
    """The least time ``passes`` (``run_cost``'s) take on a machine of these ceilings: each pass at
    least its FLOPs over the matmul peak and its bytes over the read bandwidth, whichever is longer."""
    compute = [p["flops"] / flops_per_sec for p in passes]
    memory = [p["bytes"] / bytes_per_sec for p in passes]
    return {
        "seconds": sum(map(max, compute, memory)),
        "flops": sum(p["flops"] for p in passes),
        "bytes_read": sum(p["bytes"] for p in passes),
        "memory_bound_passes": sum(m >= c for c, m in zip(compute, memory)),
        "compute_bound_passes": sum(m < c for c, m in zip(compute, memory)),
    }


def main(argv: list[str] | None = None) -> dict[str, dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n_layer", type=int, default=12)
    parser.add_argument("--n_head", type=int, default=12)
    parser.add_argument("--n_embd", type=int, default=768)
    parser.add_argument("--block_size", type=int, default=1024)
    parser.add_argument("--prompt_tokens", type=int, default=16)
    parser.add_argument("--new_tokens", type=int, default=256)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each; the median is reported")
    parser.add_argument(
        "--uncached_batch_sizes",
        type=int,
        nargs="*",
        default=[1],
        help="batch sizes to time the uncached path at (slow: one run each)",
    )
    parser.add_argument("--compile", action="store_true", help="also time generate(compile=True)")
    parser.add_argument(
        "--transformers_static",
        action="store_true",
        help="also time transformers' generate with its static cache (which it compiles itself on CUDA)",
    )
    parser.add_argument("--warm_tokens", type=int, default=8, help="tokens of the compiled step's warm-up run")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, help="torch.set_num_threads for everything timed (default: torch's)")
    parser.add_argument(
        "--probe_mb",
        type=int,
        default=READ_BYTES // 2**20,
        help="size of the memory-bandwidth probe (far above the caches; default: %(default)s)",
    )
    parser.add_argument("--out", default="benchmarks/results/cpu-2core/generation.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    try:
        import transformers
    except ImportError:  # a GPU machine without it still measures ours
        transformers = None
        print("transformers is not installed: timing ours only", flush=True)

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    config = GPTConfig(block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    ours = GPT(config).eval()
    if transformers is not None:
        with tempfile.TemporaryDirectory() as tmp:
            export_hf(ours, tmp)
            theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp).eval().to(device, dtype)
        theirs.generation_config.eos_token_id = None  # always the full number of new tokens, as ours
        theirs.generation_config.pad_token_id = 50256
    ours = ours.to(device, dtype)
    n = args.new_tokens
    # Rows of tiny Shakespeare, each long enough for the warm-up's longer prompt: real text, not random ids.
    rows, width = max(args.batch_sizes + args.uncached_batch_sizes), args.prompt_tokens + n
    text = gpt2_encoding().encode_ordinary(Corpus.tiny_shakespeare().open_text().read()[: 8 * rows * width])
    if len(text) < rows * width:
        parser.error(f"tiny Shakespeare's first {len(text)} tokens are too few for {rows} rows of {width}")
    text = torch.tensor(text[: rows * width]).view(rows, width).to(device)  # (rows, prompt_tokens + new_tokens)
    prompt = text[:, : args.prompt_tokens]
    # The same cache length as a timed run's (prompt + new tokens), a few new tokens: a short run that
    # compiles and records exactly the graphs the timed runs replay.
    warm = max(1, min(args.warm_tokens, n))
    warm_prompt = text[:, : args.prompt_tokens + n - warm]

    def run_ours(batch: int, tokens: int = n, ids: torch.Tensor = prompt, **kwargs) -> torch.Tensor:
        return generate(ours, ids[:batch], tokens, temperature=0, **kwargs)

    @torch.no_grad()
    def run_theirs(batch: int, tokens: int = n, **kwargs) -> torch.Tensor:
        ids = prompt[:batch]
        return theirs.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False, use_cache=True, **kwargs
        )

    contenders = {"ours": run_ours, **({"transformers": run_theirs} if transformers else {})}
    if args.compile:
        contenders["ours_compiled"] = lambda batch, tokens=n: run_ours(batch, tokens, compile=True)
    if args.transformers_static and transformers is not None:
        contenders["transformers_static"] = lambda batch, tokens=n: run_theirs(
            batch, tokens, cache_implementation="static"
        )
    warm_up = {
        "ours_compiled": lambda batch: run_ours(batch, warm, warm_prompt, compile=True),
        # its static cache is sized by prompt + new tokens and compiled per shape: the full run
        "transformers_static": lambda batch: contenders["transformers_static"](batch),
    }
    results: dict[str, dict] = {}
    costs = {batch: run_cost(config, batch, args.prompt_tokens, n, dtype) for batch in args.batch_sizes}

    def probe() -> None:
        """The machine's ceilings, probed again between timed rounds: the highest is the machine's
        (other jobs only ever lower it)."""
        bandwidths.append(read_bytes_per_sec(device, dtype, args.probe_mb * 2**20))
        peaks.append(matmul_flops_per_sec(device, dtype))

    bandwidths: list[float] = []
    peaks: list[float] = []
    probe()

    def report(batch: int) -> None:
        for measured in results.values():  # every row against the best ceilings so far
            b = int(measured["batch"])
            bound = roofline(costs[b]["passes"], max(peaks), max(bandwidths))
            measured["bound"] = {"tokens_per_sec": b * n / bound["seconds"], **bound}
            for name in (*contenders, "ours_uncached"):
                if name in measured:
                    measured[name]["fraction_of_bound"] = (
                        measured[name]["tokens_per_sec"] / measured["bound"]["tokens_per_sec"]
                    )
        row = results[str(batch)]
        ceilings = {
            "read_bandwidth_bytes_per_sec": max(bandwidths),
            "matmul_flops_per_sec": max(peaks),
            "matmul_dtype": args.dtype,
            "weight_bytes_per_step": costs[batch]["weight_bytes"],
            "bandwidth_probes": bandwidths,
            "matmul_probes": peaks,
        }
        bound = row["bound"]
        print(
            f"machine: {max(bandwidths) / 1e9:.1f} GB/s read, {max(peaks) / 1e12:.3g} TFLOP/s {args.dtype} matmul "
            f"(best of {len(peaks)} probes); batch {batch}: {bound['bytes_read'] / 1e9:.3g} GB read and "
            f"{bound['flops'] / 1e9:.3g} GFLOP a run, so at most {bound['tokens_per_sec']:.1f} tokens/s "
            f"({bound['memory_bound_passes']} of {len(costs[batch]['passes'])} passes bound by memory)",
            flush=True,
        )
        summary = ", ".join(
            f"{name} {row[name]['tokens_per_sec']:.1f} ({row[name]['fraction_of_bound']:.0%} of bound)"
            for name in (*contenders, "ours_uncached")
            if name in row
        )
        print(
            f"batch {batch}: tokens/s {summary}"
            + (f"; ours/transformers {row['ours_vs_transformers']:.2f}x" if "ours_vs_transformers" in row else "")
            + (f"; ours/uncached {row['ours_vs_uncached']:.1f}x" if "ours_vs_uncached" in row else "")
            + f"; greedy tokens equal: {row['greedy_tokens_equal']}",
            flush=True,
        )
        # After each measurement: what a long run on a busy machine measured survives an interruption.
        write_report(args, config, device, transformers, results, ceilings)

    if not set(args.uncached_batch_sizes) <= set(args.batch_sizes):
        parser.error("--uncached_batch_sizes must be among --batch_sizes")
    for batch in args.batch_sizes:
        times: dict[str, list[float]] = {name: [] for name in contenders}
        outputs = {}
        for name, fn in contenders.items():  # warm-up, not timed: a few tokens, the compiled step's graphs included
            warm_up[name](batch) if name in warm_up else fn(batch, min(n, 8))
        for _ in range(args.repeats):
            for name, fn in contenders.items():
                seconds, outputs[name] = timed(lambda fn=fn, batch=batch: fn(batch), device)
                times[name].append(seconds)
            probe()
        row = {
            "batch": batch,
            **{name: {"tokens_per_sec": batch * n / statistics.median(t), "seconds": t} for name, t in times.items()},
        }
        reference = outputs.get("transformers", outputs["ours"])
        row["greedy_tokens_equal"] = {
            name: bool(torch.equal(out, reference)) for name, out in outputs.items() if out is not reference
        }
        if "transformers" in row:
            row["ours_vs_transformers"] = row["ours"]["tokens_per_sec"] / row["transformers"]["tokens_per_sec"]
        if "ours_compiled" in row and "transformers" in row:  # compiled against the best of theirs
            best = max(row[name]["tokens_per_sec"] for name in ("transformers", "transformers_static") if name in row)
            row["ours_compiled_vs_transformers_best"] = row["ours_compiled"]["tokens_per_sec"] / best
        results[str(batch)] = row
        row["reference"] = reference
        report(batch)
    # The slow path last (one run each), so that a busy machine has written the rest before it.
    for batch in args.uncached_batch_sizes:
        row = results[str(batch)]
        seconds, out = timed(lambda batch=batch: run_ours(batch, use_cache=False), device)
        row["ours_uncached"] = {"tokens_per_sec": batch * n / seconds, "seconds": [seconds]}
        row["greedy_tokens_equal"]["ours_uncached"] = bool(torch.equal(out, row["reference"]))
        row["ours_vs_uncached"] = row["ours"]["tokens_per_sec"] / row["ours_uncached"]["tokens_per_sec"]
        report(batch)
    print(f"written to {args.out}")
    return results


def write_report(args, config, device, transformers, results, ceilings) -> None:
    report = {
        "benchmark": "generation",
        "model": {**vars(config)},
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "prompt": "tiny Shakespeare",
        "warm_tokens": args.warm_tokens,
        "transformers_static_compiled": args.transformers_static and device.type == "cuda",  # by transformers itself
        "repeats": args.repeats,
        "device": str(device),
        "dtype": args.dtype,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__ if transformers else None,
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "roofline": ceilings,
        # the 1-minute load average as the report is written: another job on the machine slows every contender
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "results": {batch: {k: v for k, v in row.items() if k != "reference"} for batch, row in results.items()},
    }
    atomic_write_bytes(Path(args.out), (json.dumps(report, indent=2) + "\n").encode())


if __name__ == "__main__":
    main(sys.argv[1:])
