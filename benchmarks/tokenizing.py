"""`gpt-lightning tokenize` against the usual way, on the same synthetic corpus in one run.

The usual way is build-nanogpt's fineweb.py loop, re-implemented without the Hugging Face download:
``Pool(nprocs).imap(tokenize, docs, chunksize=16)`` with one ``<|endoftext|>`` + ids array per
document, copied into one numpy array per shard. Both read the same parquet (FineWeb-edu's layout)
and JSONL files, use the same cores and the same shard size, alternated and repeated; the report gives the median tokens/s
and the highest peak memory of the whole process tree (the sum of PSS, so pages that forked workers share count once),
sampled every 50 ms. Our run is also repeated on a corpus a quarter the size: flat memory means it
does not grow with the input.

    python benchmarks/tokenizing.py                    # a 200 MB corpus; results/tokenize.json
    python benchmarks/tokenizing.py --size_mb 2 --out /tmp/t.json   # a quick look
"""

from __future__ import annotations

import sys

# Run as a script, this file's folder comes first on sys.path, where its name would shadow the
# standard library's tokenize (which linecache and traceback import).
if sys.path and __import__("os").path.realpath(sys.path[0]) == __import__("os").path.dirname(
    __import__("os").path.realpath(__file__)
):
    sys.path.pop(0)

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

REPO = Path(__file__).resolve().parents[1]


# --- the corpus ---------------------------------------------------------------------------------
def write_corpus(folder: Path, size_mb: float, seed: int = 0) -> int:
    """Documents of 200 to 20,000 characters cut from tiny Shakespeare at random, about ``size_mb`` MB
    of text, written as parquet (row groups of 200 documents) and as JSONL. Returns the count."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gpt_lightning.data.corpus import Corpus

    source = Corpus.tiny_shakespeare().read_text()
    rng = random.Random(seed)
    target, written, count = int(size_mb * 1e6), 0, 0
    (folder / "parquet").mkdir(parents=True)
    (folder / "jsonl").mkdir()
    schema = pa.schema([("text", pa.string()), ("id", pa.string()), ("score", pa.float64())])
    with (
        pq.ParquetWriter(folder / "parquet" / "000_00000.parquet", schema) as parquet,
        open(folder / "jsonl" / "000_00000.jsonl", "w") as jsonl,
    ):
        while written < target:
            docs = []
            for _ in range(200):
                length = int(min(20_000, max(200, rng.lognormvariate(7.5, 1.0))))
                start = rng.randrange(0, len(source) - length)
                docs.append(
                    f"Document {count + len(docs)} (score {rng.random():.3f}).\n{source[start : start + length]}"
                )
            parquet.write_table(
                pa.table(
                    {"text": docs, "id": [str(count + i) for i in range(len(docs))], "score": [3.0] * len(docs)},
                    schema=schema,
                )
            )
            jsonl.writelines(json.dumps({"text": d}) + "\n" for d in docs)
            written += sum(len(d) for d in docs)
            count += len(docs)
    return count


# --- build-nanogpt's loop -----------------------------------------------------------------------
def _baseline_tokenize(doc: dict) -> np.ndarray:
    import numpy as np

    from gpt_lightning.data.tokenizer import gpt2_encoding

    enc = gpt2_encoding()
    tokens = [enc.eot_token]  # the special <|endoftext|> token delimits all documents
    tokens.extend(enc.encode_ordinary(doc["text"]))
    tokens_np = np.array(tokens)
    assert (0 <= tokens_np).all() and (tokens_np < 2**16).all(), "token dictionary too large for uint16"
    return tokens_np.astype(np.uint16)


def _documents(path: Path):
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024, columns=["text"]):
            for text in batch.column(0).to_pylist():
                yield {"text": text}
    else:
        with open(path) as f:
            for line in f:
                yield json.loads(line)


def baseline(input_dir: Path, output_dir: Path, shard_size: int, nprocs: int) -> None:
    """fineweb.py's main loop, as written there."""
    import multiprocessing as mp

    import numpy as np

    output_dir.mkdir(parents=True)
    docs = (doc for path in sorted(input_dir.iterdir()) for doc in _documents(path))
    with mp.Pool(nprocs) as pool:
        shard_index = 0
        all_tokens_np = np.empty((shard_size,), dtype=np.uint16)  # preallocate buffer to hold current shard
        token_count = 0
        for tokens in pool.imap(_baseline_tokenize, docs, chunksize=16):
            if token_count + len(tokens) < shard_size:
                all_tokens_np[token_count : token_count + len(tokens)] = tokens
                token_count += len(tokens)
            else:
                split = "val" if shard_index == 0 else "train"
                filename = output_dir / f"edufineweb_{split}_{shard_index:06d}"
                remainder = shard_size - token_count
                all_tokens_np[token_count : token_count + remainder] = tokens[:remainder]
                np.save(filename, all_tokens_np)
                shard_index += 1
                all_tokens_np[0 : len(tokens) - remainder] = tokens[remainder:]
                token_count = len(tokens) - remainder
        if token_count != 0:
            split = "val" if shard_index == 0 else "train"
            np.save(output_dir / f"edufineweb_{split}_{shard_index:06d}", all_tokens_np[:token_count])


# --- measuring ------------------------------------------------------------------------------------
def _tree(pid: int) -> list[int]:
    pids, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        try:
            children = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        pids += map(int, children)
        frontier += map(int, children)
    return pids


def _pss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(command: list[str]) -> dict:
    """Wall time and peak memory (sum of PSS over the process tree) of ``command``."""
    start = time.perf_counter()
    process = subprocess.Popen(
        command,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    peak = 0
    while process.poll() is None:
        peak = max(peak, sum(_pss_bytes(p) for p in _tree(process.pid)))
        time.sleep(0.05)
    seconds = time.perf_counter() - start
    if process.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{process.stderr.read()[-3000:]}")
    return {"seconds": seconds, "peak_memory_mb": peak / 1e6}


def shard_tokens(folder: Path) -> int:
    import numpy as np

    return sum(len(np.load(p, mmap_mode="r")) for p in folder.glob("*.npy"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size_mb", type=float, default=200.0, help="text in the synthetic corpus")
    parser.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)), help="processes for both")
    parser.add_argument(
        "--shard_tokens",
        type=int,
        default=None,
        help="for both (build-nanogpt: 1e8); default: about 10 shards of the corpus",
    )
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternated; the median is reported")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "tokenize.json"))
    parser.add_argument("--baseline", nargs=3, metavar=("INPUT", "OUTPUT", "SHARD_SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline:  # the subprocess that runs build-nanogpt's loop
        baseline(Path(args.baseline[0]), Path(args.baseline[1]), int(args.baseline[2]), args.workers)
        return

    args.shard_tokens = args.shard_tokens or max(1000, int(args.size_mb * 25_000))  # ~4 characters a token
    results: dict = {
        "workers": args.workers,
        "shard_tokens": args.shard_tokens,
        "cpu": platform.processor(),
        "cores": os.cpu_count(),
        "load_average_before": os.getloadavg(),
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpora = {"full": args.size_mb, "quarter": args.size_mb / 4}
        for name, size in corpora.items():
            results[f"documents_{name}"] = write_corpus(root / name, size)
            results[f"size_mb_{name}"] = size
        ours = [
            sys.executable,
            "-m",
            "gpt_lightning",
            "tokenize",
            "--no_progress",
            "--workers",
            str(args.workers),
            "--shard_tokens",
            str(args.shard_tokens),
            "--format",
            "npy",
        ]

        def ours_run(kind: str, name: str, out: Path) -> list[str]:
            return [*ours, "--input", str(root / name / kind), "--output", str(out)]

        def baseline_run(kind: str, name: str, out: Path) -> list[str]:
            return [
                sys.executable,
                __file__,
                "--workers",
                str(args.workers),
                "--baseline",
                str(root / name / kind),
                str(out),
                str(args.shard_tokens),
            ]

        # Alternated and repeated: the machine may be shared, and its load drifts.
        plan = [
            (who, kind, "full")
            for _ in range(args.repeats)
            for kind in ("parquet", "jsonl")
            for who in ("ours", "build-nanogpt")
        ]
        plan += [("ours", kind, "quarter") for kind in ("parquet", "jsonl")]
        for i, (who, kind, name) in enumerate(plan):
            out = root / f"out{i}"
            run = measure((ours_run if who == "ours" else baseline_run)(kind, name, out))
            run["tokens"] = shard_tokens(out)
            shutil.rmtree(out)
            results["runs"].setdefault(f"{who}/{kind}/{name}", []).append(run)
            print(
                f"{who} {kind} {name}: {run['tokens'] / run['seconds'] / 1e6:.2f}M tokens/s, "
                f"{run['peak_memory_mb']:.0f} MB",
                file=sys.stderr,
            )
    for key, runs in results["runs"].items():  # the median rate, the highest peak
        assert len({r["tokens"] for r in runs}) == 1
        results["runs"][key] = {
            "tokens": runs[0]["tokens"],
            "runs": runs,
            "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in runs),
            "peak_memory_mb": max(r["peak_memory_mb"] for r in runs),
        }
    results["load_average_after"] = os.getloadavg()
    table = ["| input | run | tokens | tokens/s | peak memory |", "|---|---|---|---|---|"]
    for key, run in results["runs"].items():
        who, kind, name = key.split("/")
        size = results[f"size_mb_{name}"]
        table.append(
            f"| {kind}, {size:g} MB | {who} | {run['tokens']:,} | {run['tokens_per_s'] / 1e6:.2f}M | "
            f"{run['peak_memory_mb']:,.0f} MB |"
        )
    for kind in ("parquet", "jsonl"):
        ours_run, base = results["runs"][f"ours/{kind}/full"], results["runs"][f"build-nanogpt/{kind}/full"]
        assert ours_run["tokens"] == base["tokens"], "both must write the same tokens"
        results[f"speed_ratio_{kind}"] = ours_run["tokens_per_s"] / base["tokens_per_s"]
        results[f"memory_ratio_{kind}"] = ours_run["peak_memory_mb"] / base["peak_memory_mb"]
        table.append(
            f"\n{kind}: ours is {results[f'speed_ratio_{kind}']:.2f}x build-nanogpt's tokens/s at "
            f"{results[f'memory_ratio_{kind}']:.2f}x its memory"
        )
    results["table"] = "\n".join(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    print(results["table"])
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
