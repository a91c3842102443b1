"""``gpt-lightning eval --task hellaswag``: score a checkpoint, or a Hugging Face GPT-2, on HellaSwag."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gpt_lightning.interop.checkpoint import gpt_from_checkpoint
from gpt_lightning.commands.sample import resolve_device
from gpt_lightning.data.corpus import default_cache_dir
from gpt_lightning.data.tokenizer import gpt2_encoding
from gpt_lightning.errors import UserError
from gpt_lightning.interop.hellaswag import evaluate, read_examples, validation_file
from gpt_lightning.model import GPT
from gpt_lightning.atomic import atomic_write_bytes
from gpt_lightning.interop.pretrained import gpt_from_hf


def load_model(ckpt_path: str | None, init_from: str | None) -> GPT:
    if (ckpt_path is None) == (init_from is None):
        raise UserError("Give exactly one of --ckpt_path (a gpt-lightning checkpoint) and --init_from (a Hugging Face GPT-2).")
    return gpt_from_checkpoint(ckpt_path) if ckpt_path is not None else gpt_from_hf(init_from)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="gpt-lightning eval", description=__doc__)
    parser.add_argument("--task", choices=["hellaswag"], required=True)
    parser.add_argument("--ckpt_path", help="a .ckpt written by gpt-lightning fit")
    parser.add_argument("--init_from", help="a Hugging Face GPT-2: hub name (gpt2, ...), directory or weights file")
    parser.add_argument("--data_file", help="hellaswag_val.jsonl; default: downloaded once into the cache")
    parser.add_argument("--limit", type=int, help="score only the first N examples")
    parser.add_argument("--batch_size", type=int, default=8, help="examples per forward pass (4 rows each; default: %(default)s)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ... (default: %(default)s)")
    parser.add_argument("--out", help="also write the result to this JSON file")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        raise UserError(f"--limit must be at least 1, got {args.limit}.")
    if args.batch_size < 1:
        raise UserError(f"--batch_size must be at least 1, got {args.batch_size}.")
    device = resolve_device(args.device)
    model = load_model(args.ckpt_path, args.init_from)
    path = Path(args.data_file) if args.data_file else validation_file(default_cache_dir())
    encode = gpt2_encoding().encode_ordinary
    result = evaluate(model, read_examples(path), encode, device, args.limit, args.batch_size)
    print(f"hellaswag: acc_norm {result['acc_norm']:.4f}, acc {result['acc']:.4f} over {result['examples']} examples")
    if args.out:
        atomic_write_bytes(Path(args.out), (json.dumps({"task": "hellaswag", **result}, indent=2) + "\n").encode())
