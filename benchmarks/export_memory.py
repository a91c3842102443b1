"""Peak host memory of `gpt-lightning export` for a big model, against the bytes of its weights.

A checkpoint of the chosen GPT-2 shape (float32 weights and the saved hyper-parameters, as
`gpt-lightning fit` writes them; no optimizer state, which export never reads) is written by one
process; then each way of exporting runs in a fresh process of its own that reports its peak
resident memory (ru_maxrss: the Python interpreter and torch included, memory-mapped checkpoint
pages as they are read included):

- `gpt-lightning export`: the checkpoint's memory-mapped tensors become the weights of a GPT built
  on the meta device (``GPT.from_state_dict``), and safetensors writes them from there.
- `naive`, for comparison: what export did before, a randomly initialized GPT built first, then the
  checkpoint copied into it.

Target: export's peak under 1.3x the weights' bytes.

    python benchmarks/export_memory.py --shape gpt2-large
    python benchmarks/export_memory.py --shape gpt2-xl      # 6.2 GB of weights: needs ~15 GB free
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = {  # (n_layer, n_head, n_embd); vocabulary 50257, 1024 positions
    "gpt2": (12, 12, 768),
    "gpt2-medium": (24, 16, 1024),
    "gpt2-large": (36, 20, 1280),
    "gpt2-xl": (48, 25, 1600),
    "tiny": (1, 2, 32),  # the test's smoke run: the interpreter dominates, the ratio means nothing
}

WRITE = """
import sys, torch
from gpt_lightning.model import GPT, GPTConfig
hparams = dict(n_layer={n_layer}, n_head={n_head}, n_embd={n_embd}, vocab_size=50257, block_size=1024, bias=True, dropout=0.0)
with torch.device("meta"):
    shapes = GPT(GPTConfig(**hparams)).state_dict()
# one tensor per name, wte and lm_head sharing storage as in a real checkpoint
made = {{}}
state = {{}}
for name, t in shapes.items():
    key = (t.shape, name.replace("lm_head", "transformer.wte"))
    state["model." + name] = made.setdefault(key, torch.full(t.shape, 0.01))
torch.save({{"state_dict": state, "hyper_parameters": hparams}}, sys.argv[1])
print(sum(t.numel() * t.element_size() for t in made.values()))
"""

MEASURE = """
import json, resource, sys
mode, ckpt, out = sys.argv[1:4]
if mode == "export":
    from gpt_lightning.cli import main
    main(["export", "--ckpt_path", ckpt, "--out", out])
else:  # naive: a random GPT first, then the checkpoint copied into it
    import torch
    from safetensors.torch import save_file
    from gpt_lightning.interop.checkpoint import read_checkpoint, saved_config
    from gpt_lightning.model import GPT
    checkpoint = read_checkpoint(ckpt)
    model = GPT(saved_config(checkpoint))
    model.load_state_dict({k[len("model."):]: v for k, v in checkpoint["state_dict"].items()})
    save_file({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, out)
print(json.dumps({"peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def run(code: str, *args: str) -> str:
    result = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    return result.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=SHAPES, default="gpt2-large")
    parser.add_argument("--modes", nargs="+", default=["export", "naive"], choices=["export", "naive"])
    parser.add_argument("--workdir", default=None, help="where the checkpoint is written (default: a temporary folder)")
    args = parser.parse_args()
    n_layer, n_head, n_embd = SHAPES[args.shape]
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        ckpt = str(Path(tmp) / "model.ckpt")
        weight_bytes = int(run(WRITE.format(n_layer=n_layer, n_head=n_head, n_embd=n_embd), ckpt))
        result = {"shape": args.shape, "weight_bytes": weight_bytes}
        for mode in args.modes:
            peak = json.loads(run(MEASURE, mode, ckpt, str(Path(tmp) / f"{mode}.safetensors")))["peak_bytes"]
            result[mode] = {"peak_bytes": peak, "peak_over_weights": round(peak / weight_bytes, 3)}
            print(
                f"{mode:>7}: peak {peak / 2**30:.2f} GiB = {peak / weight_bytes:.2f}x the weights' "
                f"{weight_bytes / 2**30:.2f} GiB",
                flush=True,
            )
        print(json.dumps(result))


if __name__ == "__main__":
    main()
