#!/bin/bash
# GPT-2 124M on one node of N GPUs with torchrun, coming back by itself when a rank dies (killed,
# out of memory, a GPU fault): torchrun stops the other ranks and relaunches all of them, up to
# --max-restarts times, and `--ckpt_path last` resumes each relaunch from the newest last.ckpt of
# logs/gpt2-124m-fineweb/ (the first launch, with none yet, starts fresh). docs/resume.md explains.
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 with --standalone (or --rdzv-backend c10d): each attempt
# meets in a store of its own. Without it torchrun's agent keeps one store for every attempt, and
# the relaunched ranks can read the dead ranks' addresses there and hang (torch issue 135712).
set -euo pipefail
NPROC="${NPROC:-8}"
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node "$NPROC" --max-restarts 3 \
    -m gpt_lightning fit --config configs/gpt2-124m-fineweb.yaml \
    --trainer.devices "$NPROC" --trainer.strategy ddp --ckpt_path last
