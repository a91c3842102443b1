"""The data path must never be the bottleneck: batches served per second vs tokens trained per second.

Iterates ``TokenStreamDataModule``'s training loader (memory-mapped uint16 cache, zero-copy slicing,
one int64 conversion per batch; pinned and copied to the GPU when there is one) for many batches and
reports its tokens/sec next to the rate training consumes: by default the reference's compiled
GPT-2 124M on one GPU, about 180,000 tokens/s.

    python benchmarks/data_loading.py
    python benchmarks/data_loading.py --training_tokens_per_sec 3700   # the tiny-cpu model here
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gpt_lightning import TokenStreamDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_path", default=None, help="text file or shard directory; default: tiny Shakespeare")
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--block_size", type=int, default=1024)
    parser.add_argument("--batches", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5, help="timed passes; the median is reported")
    parser.add_argument("--training_tokens_per_sec", type=float, default=180_000.0)
    args = parser.parse_args()

    data = TokenStreamDataModule(
        args.data_path, batch_size=args.batch_size, block_size=args.block_size, val_fraction=0.0
    )
    data.prepare_data()
    data.setup("fit")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    loader = torch.utils.data.DataLoader(
        data.train_dataloader().dataset, batch_size=None, num_workers=0, pin_memory=device.type == "cuda"
    )
    rates = []
    for _ in range(args.repeats):
        served, batches = 0, iter(loader)
        start = time.perf_counter()
        while served < args.batches:
            batch = next(batches, None)
            if batch is None:
                batches = iter(loader)
                continue
            x, y = (t.to(device, non_blocking=True) for t in batch)
            served += 1
        if device.type == "cuda":
            torch.cuda.synchronize()
        rates.append(served * args.batch_size * args.block_size / (time.perf_counter() - start))
    rate = statistics.median(rates)
    print(f"data module: {rate:,.0f} tokens/s served (B={args.batch_size}, T={args.block_size}, to {device})")
    print(
        f"training consumes {args.training_tokens_per_sec:,.0f} tokens/s: data is {rate / args.training_tokens_per_sec:,.0f}x faster"
    )


if __name__ == "__main__":
    main()
