#!/bin/bash
# GPT-2 124M on one node of N GPUs with torchrun, coming back by itself when a rank dies (killed,
# out of memory, a GPU fault): torchrun stops the other ranks and relaunches all of them, up to
# --max-restarts times, and `--ckpt_path last` resumes each relaunch from the newest last.ckpt of
# logs/gpt2-124m-fineweb/ (the first launch needs a last.ckpt already: run the same line once
# without --ckpt_path last, or let the first allocation of the job do so). docs/resume.md explains.
# Known problem (docs/resume.md, "torchrun restarts"): on the CPU (gloo, torch 2.13) the relaunched
# ranks often fail to meet (stale addresses of the dead ranks); not yet checked with NCCL.
set -euo pipefail
NPROC="${NPROC:-8}"
torchrun --nproc-per-node "$NPROC" --max-restarts 3 --master-addr 127.0.0.1 --master-port "${MASTER_PORT:-29500}" \
    -m gpt_lightning fit --config configs/gpt2-124m-fineweb.yaml \
    --trainer.devices "$NPROC" --trainer.strategy ddp --ckpt_path last
