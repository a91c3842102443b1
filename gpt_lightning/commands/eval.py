"""``gpt-lightning eval``: score a checkpoint, or a Hugging Face GPT-2, on lm-evaluation-harness tasks
(``--tasks``), on HellaSwag as build-nanogpt scores it (``--task hellaswag``), or by its bits per
byte on a text file (``--text_file``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from gpt_lightning.atomic import atomic_write_bytes
from gpt_lightning.errors import UserError

# torch, the model and lm_eval are imported where used: `eval --help` answers without them.
DTYPES = ("float32", "bfloat16", "float16")


def load_model(ckpt_path: str | None, init_from: str | None):
    """The ``GPT`` of a checkpoint or of a Hugging Face GPT-2."""
    if (ckpt_path is None) == (init_from is None):
        raise UserError(
            "Give exactly one of --ckpt_path (a gpt-lightning checkpoint) and --init_from (a Hugging Face GPT-2)."
        )
    if ckpt_path is not None:
        from gpt_lightning.interop.checkpoint import gpt_from_checkpoint

        return gpt_from_checkpoint(ckpt_path)
    from gpt_lightning.interop.pretrained import gpt_from_hf

    return gpt_from_hf(init_from)


def limit_value(text: str) -> int | float:
    """``--limit``: a count of examples, or (below 1) a share of each task, as the harness reads it."""
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {text}")
    return int(value) if value >= 1 and value.is_integer() else value


def batch_size_value(text: str) -> int | str:
    """``--batch_size``: a number, or ``auto`` / ``auto:N`` as the harness takes them."""
    if text == "auto" or (text.startswith("auto:") and text[5:].isdigit()):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number, auto or auto:N, got {text}") from None


def seed_value(text: str) -> list[int | None]:
    """``--seed``, as the harness reads it: one number for all four seeds, or 3-4 comma-separated."""
    items = [item.strip() for item in text.split(",")]
    try:
        values = [None if item.lower() == "none" else int(item) for item in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number or 4 comma-separated numbers (or None), got {text}") from None
    if len(values) == 1:
        return values * 4
    if not 3 <= len(values) <= 4:
        raise argparse.ArgumentTypeError(f"1 or 4 comma-separated values, got {len(values)}")
    return values + SEEDS[len(values) :]


SEEDS = [0, 1234, 1234, 1234]  # the harness's defaults: random, numpy, torch, few-shot


def gen_kwargs_value(values: list[str] | None) -> dict[str, Any] | None:
    """``--gen_kwargs`` as the harness parses it: ``temperature=0,top_p=0.9`` (or several such words, or a JSON object)."""
    if not values:
        return None
    from lm_eval.utils import simple_parse_args_string

    try:
        parsed = json.loads(values[0])
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        return parsed
    merged: dict[str, Any] = {}
    for value in values:
        if "=" not in value:
            raise UserError(f"--gen_kwargs {value!r}: give key=value pairs, such as temperature=0,top_p=0.9.")
        merged.update(simple_parse_args_string(value))
    return merged or None


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpt-lightning eval", description=__doc__)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--tasks", help="lm-evaluation-harness tasks or groups, comma-separated (hellaswag,...)")
    which.add_argument("--task", choices=["hellaswag"], help="HellaSwag scored build-nanogpt's way (docs/hellaswag.md)")
    which.add_argument("--text_file", help="bits per byte of this UTF-8 text, in the harness's rolling windows")
    parser.add_argument("--ckpt_path", help="a .ckpt written by gpt-lightning fit")
    parser.add_argument("--init_from", help="a Hugging Face GPT-2: hub name (gpt2, ...), directory or weights file")
    parser.add_argument("--include_path", help="--tasks: a folder of your own task YAMLs (e.g. on local data files)")
    parser.add_argument("--num_fewshot", type=int, help="--tasks: examples in each prompt (default: each task's own)")
    parser.add_argument(
        "--limit", type=limit_value, help="score the first N examples of each task (--tasks: <1, a share)"
    )
    parser.add_argument(
        "--batch_size",
        type=batch_size_value,
        default=8,
        help="requests (hellaswag: examples) per forward pass; --tasks: auto (or auto:N) halves --max_batch_size "
        "until it fits (default: %(default)s)",
    )
    parser.add_argument("--max_batch_size", type=int, default=64, help="--batch_size auto's largest (default: 64)")
    parser.add_argument(
        "--gen_kwargs",
        nargs="+",
        metavar="KEY=VALUE",
        help="--tasks: generation options over every generation task's own, e.g. temperature=0,top_p=0.9",
    )
    parser.add_argument(
        "--seed",
        type=seed_value,
        default=SEEDS,
        help="--tasks: Python's, NumPy's, torch's and few-shot seeds: one for all, or four comma-separated "
        "(None: unset; default: 0,1234,1234,1234)",
    )
    parser.add_argument(
        "--use_cache",
        metavar="PATH",
        help="--tasks: cache answers in PATH_rank0.db as computed; a rerun scores only what is not there",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ... (default: %(default)s)")
    parser.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="bfloat16/float16 run under autocast; auto: bfloat16 where native, else the checkpoint's own",
    )
    parser.add_argument(
        "--output_path",
        help="write the results JSON here (--tasks: a folder or suffix-less path gets results.json)",
    )
    parser.add_argument(
        "--log_samples",
        action="store_true",
        help="--tasks: also write each request's inputs and outputs beside the results (samples_<task>.jsonl)",
    )
    parser.add_argument("--bootstrap_iters", type=int, default=100_000, help="--tasks: resamples for stderr; 0: none")
    parser.add_argument("--data_file", help="--task hellaswag: hellaswag_val.jsonl; default: downloaded once, cached")
    parser.add_argument("--out", help="--task hellaswag: also write the result to this JSON file")
    return parser


def main(argv: list[str]) -> None:
    args = parser().parse_args(argv)
    auto = isinstance(args.batch_size, str)
    if auto and args.tasks is None:
        raise UserError("--batch_size auto is for --tasks: give --task hellaswag and --text_file a number.")
    if not auto and args.batch_size < 1:
        raise UserError(f"--batch_size must be at least 1, got {args.batch_size}.")
    if args.max_batch_size < 1:
        raise UserError(f"--max_batch_size must be at least 1, got {args.max_batch_size}.")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise UserError(f"--num_fewshot must be 0 or more, got {args.num_fewshot} (leave it out for each task's own).")
    if args.task is not None:
        return hellaswag(args)
    if args.text_file is not None:
        return text_bits_per_byte_of(args)
    if args.log_samples and not args.output_path:
        raise UserError("--log_samples writes the samples beside the results: give --output_path too.")
    from gpt_lightning.evaluation.tasks import import_lm_eval, run_tasks

    import_lm_eval()  # before loading a model: a missing install is said first
    from gpt_lightning.evaluation.harness_model import GPTHarnessLM

    gen_kwargs = gen_kwargs_value(args.gen_kwargs)
    device, dtype = device_and_dtype(args)
    lm = GPTHarnessLM(
        load_model(args.ckpt_path, args.init_from),
        batch_size=1 if auto else args.batch_size,
        device=device,
        dtype=dtype,
    )
    if auto:
        lm.batch_size = lm.auto_batch_size(args.max_batch_size)
        print(f"--batch_size {args.batch_size}: {lm.batch_size}")
    tasks = [name.strip() for name in args.tasks.split(",") if name.strip()]
    results = run_tasks(
        lm,
        tasks,
        num_fewshot=args.num_fewshot,
        limit=args.limit,
        include_path=args.include_path,
        log_samples=args.log_samples,
        bootstrap_iters=args.bootstrap_iters,
        gen_kwargs=gen_kwargs,
        seeds=args.seed,
        use_cache=args.use_cache,
    )
    from lm_eval.utils import make_table

    print(make_table(results))
    if results.get("groups"):
        print(make_table(results, "groups"))
    if args.output_path:
        write_results(results, Path(args.output_path))


def device_and_dtype(args: argparse.Namespace):
    """``--device`` and ``--dtype`` (torch's); ``auto``: bfloat16 where native, else None (the model's own)."""
    import torch

    from gpt_lightning.commands.sample import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    if args.dtype != "auto":
        return device, getattr(torch, args.dtype)
    dtype = resolve_dtype("auto", device)
    return device, dtype if dtype == torch.bfloat16 else None


def model_to_score(args: argparse.Namespace):
    """The model to score on ``--device`` in eval mode, and its context: autocast for a half ``--dtype``."""
    import torch

    device, dtype = device_and_dtype(args)
    autocast = dtype in (torch.bfloat16, torch.float16)
    model = load_model(args.ckpt_path, args.init_from).to(device=device, dtype=None if autocast else dtype).eval()
    return model, device, lambda: torch.autocast(device.type, dtype=dtype, enabled=autocast)


def text_bits_per_byte_of(args: argparse.Namespace) -> None:
    """``--text_file``: the text's bits per byte, as ``val/bpb`` counts them."""
    from gpt_lightning.data.tokenizer import gpt2_encoding
    from gpt_lightning.training.bits_per_byte import text_bits_per_byte

    path = Path(args.text_file)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise UserError(f"--text_file {path} is not UTF-8 text ({err.reason} at byte {err.start}).") from None
    ids = gpt2_encoding().encode_ordinary(text)
    if not ids:
        raise UserError(f"--text_file {path} is empty.")
    model, device, run_in = model_to_score(args)
    with run_in():
        result = text_bits_per_byte(model, ids, device, args.batch_size)
    print(f"{path}: {result['bpb']:.4f} bits per byte over {result['bytes']:,} bytes ({result['tokens']:,} tokens)")
    if args.output_path:
        atomic_write_bytes(
            Path(args.output_path), (json.dumps({"text_file": str(path), **result}, indent=2) + "\n").encode()
        )


def write_results(results: dict[str, Any], path: Path) -> None:
    """The results JSON at ``path`` (a folder, or a new path without a suffix: ``results.json`` in it), samples
    beside it as ``samples_<task>.jsonl``."""
    from lm_eval.utils import handle_non_serializable

    folder = path.is_dir() or (not path.exists() and not path.suffix)
    path = path / "results.json" if folder else path
    samples = results.pop("samples", None) or {}
    atomic_write_bytes(
        path, (json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False) + "\n").encode()
    )
    for task, rows in samples.items():
        lines = "".join(json.dumps(row, default=handle_non_serializable, ensure_ascii=False) + "\n" for row in rows)
        atomic_write_bytes(path.parent / f"samples_{task}.jsonl", lines.encode())
    print(f"wrote {path}" + (f" and {len(samples)} samples file(s) beside it" if samples else ""))


def hellaswag(args: argparse.Namespace) -> None:
    """``--task hellaswag``: build-nanogpt's figure (acc_norm: mean loss per ending token)."""
    from gpt_lightning.data.corpus import default_cache_dir
    from gpt_lightning.data.tokenizer import gpt2_encoding
    from gpt_lightning.interop.hellaswag import evaluate, read_examples, validation_file

    if args.limit is not None and (args.limit < 1 or not isinstance(args.limit, int)):
        raise UserError(f"--limit must be a whole number of examples for --task hellaswag, got {args.limit}.")
    model, device, run_in = model_to_score(args)
    path = Path(args.data_file) if args.data_file else validation_file(default_cache_dir())
    encode = gpt2_encoding().encode_ordinary
    result = evaluate(model, read_examples(path), encode, device, args.limit, args.batch_size, run_in)
    print(f"hellaswag: acc_norm {result['acc_norm']:.4f}, acc {result['acc']:.4f} over {result['examples']} examples")
    if args.out:
        atomic_write_bytes(Path(args.out), (json.dumps({"task": "hellaswag", **result}, indent=2) + "\n").encode())
