#!/bin/bash
# GPT-2 124M on N nodes x 8 GPUs with torchrun: run this on every node with NODE_RANK 0..N-1 and
# MASTER_ADDR set to node 0's address. Lightning reads torchrun's environment, so the command is the
# same `gpt-lightning fit` as on one GPU.
#
# One command for the first launch and every relaunch: `--ckpt_path last` starts fresh when no run
# has a checkpoint yet, resumes the newest run's last.ckpt otherwise, and exits 0 once the run
# reached max_steps. On SIGTERM torchrun signals its workers, which finish the optimizer step, save
# last.ckpt and exit 143; torchrun then exits non-zero: relaunch this script until it exits 0.
set -euo pipefail
NNODES="${NNODES:-2}"
exec torchrun --nnodes "$NNODES" --node_rank "${NODE_RANK:?set NODE_RANK}" --nproc_per_node 8 \
    --master_addr "${MASTER_ADDR:?set MASTER_ADDR}" --master_port "${MASTER_PORT:-29500}" \
    -m gpt_lightning fit --config configs/gpt2-124m-fineweb.yaml --ckpt_path last \
    --trainer.num_nodes "$NNODES" --trainer.devices 8 --trainer.strategy ddp
