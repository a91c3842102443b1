"""``gpt-lightning tokenize``: a folder of .txt files to GPT-2 ``.npy`` shards."""

from __future__ import annotations

import argparse
from pathlib import Path

from gpt_lightning.data.shards import tokenize_folder


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="gpt-lightning tokenize",
        description="Tokenize a folder of .txt files into GPT-2 .npy shards for --data.data_path.",
    )
    parser.add_argument("--input", required=True, help="folder searched recursively for .txt files")
    parser.add_argument("--output", required=True, help="folder for the shards")
    parser.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard")
    args = parser.parse_args(argv)
    shards = tokenize_folder(Path(args.input), Path(args.output), args.shard_tokens)
    print(f"wrote {len(shards)} shard(s) to {args.output} (first is the validation split)")
