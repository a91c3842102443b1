"""``gpt-lightning export``: the plain GPT weights of a checkpoint, as safetensors."""

from __future__ import annotations

import argparse

from gpt_lightning.weights import export_weights


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="gpt-lightning export",
        description="Write the plain GPT weights of a checkpoint to a safetensors file "
        "(load it with gpt_lightning.load_gpt, no Lightning needed).",
    )
    parser.add_argument("--ckpt_path", required=True, help="a .ckpt written by gpt-lightning fit")
    parser.add_argument("--out", required=True, help="output .safetensors path")
    args = parser.parse_args(argv)
    print(f"wrote {export_weights(args.ckpt_path, args.out)}")
