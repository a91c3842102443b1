"""``gpt-lightning export``: the GPT weights of a checkpoint, as one safetensors file (for
``gpt_lightning.load_gpt``) or as a Hugging Face GPT-2 directory (for ``transformers``)."""

from __future__ import annotations

import argparse

from gpt_lightning.interop.checkpoint import gpt_from_checkpoint
from gpt_lightning.interop.pretrained import export_hf
from gpt_lightning.interop.weights import export_weights


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="gpt-lightning export", description=__doc__)
    parser.add_argument("--ckpt_path", required=True, help="a .ckpt written by gpt-lightning fit")
    parser.add_argument("--out", required=True, help="output .safetensors file, or directory for --format hf")
    parser.add_argument(
        "--format",
        choices=["safetensors", "hf"],
        default="safetensors",
        help="safetensors: one file, loaded by gpt_lightning.load_gpt; hf: a Hugging Face GPT-2 folder "
        "(config.json + model.safetensors) for transformers (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.format == "hf":
        print(f"wrote {export_hf(gpt_from_checkpoint(args.ckpt_path), args.out)}")
    else:
        print(f"wrote {export_weights(args.ckpt_path, args.out)}")
