"""``gpt-lightning tokenize``: text, JSONL or parquet documents to GPT-2 shards, on every core."""

from __future__ import annotations

import argparse
from pathlib import Path

from gpt_lightning.data.documents import SUFFIXES
from gpt_lightning.data.encode import default_workers
from gpt_lightning.data.shard_writer import FORMATS, tokenize_to_shards


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="gpt-lightning tokenize",
        description="Tokenize documents into GPT-2 shards for --data.data_path: each document begins with "
        "<|endoftext|>, the first shard is the validation split (as build-nanogpt writes them).",
    )
    parser.add_argument("--input", required=True, help=f"a file, folder or glob of {', '.join(SUFFIXES)} files")
    parser.add_argument("--output", required=True, help="folder for the shards (must hold none yet)")
    parser.add_argument("--shard_tokens", type=int, default=100_000_000, help="tokens per shard (default: 100M)")
    parser.add_argument(
        "--format",
        choices=list(FORMATS),
        default="npy",
        help="npy: build-nanogpt's .npy (default); llmc: llm.c's .bin with its header; "
        "ours: raw uint16 .bin (nanoGPT's layout) counted in tokenize.json",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=default_workers(),
        help="processes that encode, for the same bytes (default: every core, here %(default)s)",
    )
    parser.add_argument("--text_key", default="text", help="the text field of JSONL lines, column of parquet files")
    parser.add_argument("--separator", help="split .txt files into documents on this string (default: one per file)")
    parser.add_argument("--no_progress", action="store_true", help="no progress line")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    shards = tokenize_to_shards(
        args.input,
        Path(args.output),
        args.shard_tokens,
        args.format,
        args.workers,
        args.text_key,
        args.separator,
        progress=not args.no_progress,
    )
    tokens = sum(n for _, n in shards)
    print(f"wrote {len(shards)} shard(s), {tokens:,} tokens, to {args.output} (the first is the validation split)")
