#!/bin/bash
# GPT-2 124M on N nodes x 8 GPUs with torchrun: run this on every node with NODE_RANK 0..N-1 and
# MASTER_ADDR set to node 0's address. Lightning reads torchrun's environment, so the command is the
# same `gpt-lightning fit` as on one GPU.
set -euo pipefail
NNODES="${NNODES:-2}"
torchrun --nnodes "$NNODES" --node_rank "${NODE_RANK:?set NODE_RANK}" --nproc_per_node 8 \
    --master_addr "${MASTER_ADDR:?set MASTER_ADDR}" --master_port "${MASTER_PORT:-29500}" \
    -m gpt_lightning fit --config configs/gpt2-124m-fineweb.yaml \
    --trainer.num_nodes "$NNODES" --trainer.devices 8 --trainer.strategy ddp
