"""``gpt-lightning sample``: text from a checkpoint, decoded with the GPT-2 encoding."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from gpt_lightning.errors import UserError
from gpt_lightning.module import GPTLightningModule
from gpt_lightning.data.tokenizer import gpt2_encoding


def sample(
    ckpt_path: str | Path,
    prompt: str = "\n",
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 200,
    num_samples: int = 1,
    seed: int = 42,
    device: str = "auto",
) -> list[str]:
    """Continuations of ``prompt`` sampled from a ``gpt-lightning`` checkpoint."""
    if not Path(ckpt_path).is_file():
        raise UserError(f"Checkpoint {ckpt_path} does not exist.")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    module = GPTLightningModule.load_from_checkpoint(ckpt_path, map_location=device, compile=False)
    model = module.model.eval()
    encoding = gpt2_encoding()
    ids = encoding.encode_ordinary(prompt) or [encoding.eot_token]
    if len(ids) > model.config.block_size:
        ids = ids[-model.config.block_size :]
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)  # (num_samples, T)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, max_new_tokens, temperature=temperature, top_k=top_k, generator=generator)
    return [encoding.decode(row.tolist()) for row in out]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="gpt-lightning sample", description=__doc__)
    parser.add_argument("--ckpt_path", required=True, help="a .ckpt written by gpt-lightning fit")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a new line)")
    parser.add_argument("--max_new_tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest tokens")
    parser.add_argument("--num_samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    args = parser.parse_args(argv)
    texts = sample(**vars(args))
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i}")
        print(text)
