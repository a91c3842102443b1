"""``gpt-lightning sample``: text from a checkpoint, decoded with the GPT-2 encoding."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from gpt_lightning.data.tokenizer import gpt2_encoding
from gpt_lightning.errors import UserError
from gpt_lightning.generation import generate
from gpt_lightning.interop.checkpoint import gpt_from_checkpoint
from gpt_lightning.training.compilation import check_kernels_can_build


def resolve_device(device: str) -> torch.device:
    """``auto`` (CUDA when there is one, else CPU) or a torch device string, checked to exist."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise UserError(f"--device {device!r} is not a device. Use auto, cpu, cuda or cuda:N.") from None
    if resolved.type not in ("cpu", "cuda"):  # mps, xpu, meta...: not what gpt-lightning runs on
        raise UserError(
            f"--device {device}: gpt-lightning samples and evaluates on cpu or cuda. Use auto, cpu, cuda or cuda:N."
        )
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA GPU is available here. Use --device cpu (or auto).")
    if resolved.type == "cuda" and resolved.index is not None and resolved.index >= torch.cuda.device_count():
        raise UserError(
            f"--device {device}: this machine has {torch.cuda.device_count()} CUDA GPU(s), cuda:0 to "
            f"cuda:{torch.cuda.device_count() - 1}."
        )
    return resolved


SAMPLE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 where the device runs it natively (said on stderr), else float32."""
    if dtype != "auto":
        return getattr(torch, dtype)
    from gpt_lightning.training.precision import fast_dtype

    chosen, why = fast_dtype(device)
    print(f"--dtype auto: {str(chosen).removeprefix('torch.')} ({why}).", file=sys.stderr)
    return chosen


def sample(
    ckpt_path: str | Path,
    prompt: str = "\n",
    max_new_tokens: int = 200,
    temperature: float = 0.8,
    top_k: int | None = 200,
    num_samples: int = 1,
    seed: int = 42,
    device: str = "auto",
    compile: bool = False,
    dtype: str = "auto",
) -> list[str]:
    """Continuations of ``prompt`` from a ``gpt-lightning`` checkpoint, ``num_samples`` in one batch, the
    weights and cache in ``dtype`` (docs/sampling.md)."""
    for name, value, least in (
        ("max_new_tokens", max_new_tokens, 0),
        ("num_samples", num_samples, 1),
        ("top_k", top_k, 0),
    ):
        if value is not None and value < least:
            raise UserError(f"--{name} must be at least {least}, got {value}.")
    if temperature < 0:
        raise UserError(f"--temperature must be >= 0 (0 is greedy), got {temperature}.")
    if dtype not in SAMPLE_DTYPES:
        raise UserError(f"--dtype {dtype!r} is not one of {', '.join(SAMPLE_DTYPES)}.")
    torch_device = resolve_device(device)
    if compile:
        check_kernels_can_build(torch_device.type)
    model = gpt_from_checkpoint(ckpt_path).to(torch_device, resolve_dtype(dtype, torch_device)).eval()
    encoding = gpt2_encoding()
    if model.config.vocab_size < encoding.n_vocab:
        raise UserError(
            f"{ckpt_path} has a vocabulary of {model.config.vocab_size} tokens, fewer than the GPT-2 encoding's "
            f"{encoding.n_vocab} that `sample` reads and writes text with. Sample from it in Python with your "
            "own tokenizer: gpt_lightning.generation.generate(gpt_lightning.interop.checkpoint.gpt_from_checkpoint(path), ids, ...)."
        )
    ids = (encoding.encode_ordinary(prompt) or [encoding.eot_token])[-model.config.block_size :]
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=torch_device)  # (num_samples, T)
    out = generate(
        model,
        idx,
        max_new_tokens,
        temperature=temperature,
        top_k=top_k or None,  # 0: the whole vocabulary
        generator=torch.Generator(device=torch_device).manual_seed(seed),
        vocab_limit=encoding.n_vocab,
        compile=compile,
    )
    return [encoding.decode(row.tolist()) for row in out]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="gpt-lightning sample", description=__doc__)
    parser.add_argument("--ckpt_path", required=True, help="a .ckpt written by gpt-lightning fit")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a new line)")
    parser.add_argument("--max_new_tokens", type=int, default=200, help="tokens to add (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default: %(default)s)")
    parser.add_argument("--top_k", type=int, default=200, help="sample among the k likeliest; 0: all (default: 200)")
    parser.add_argument("--num_samples", type=int, default=1, help="continuations, in one batch (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=42, help="the same seed gives the same text (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ... (default: %(default)s)")
    parser.add_argument("--compile", action="store_true", help="compile the decode step: pays for long or many samples")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=SAMPLE_DTYPES,
        help="weights' type while sampling; auto: bfloat16 where native, else float32 (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    texts = sample(**vars(args))
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i}")
        print(text)
