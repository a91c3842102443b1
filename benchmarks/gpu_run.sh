#!/usr/bin/env bash
# The GPU run: on one CUDA GPU, in a few minutes, from the repository root:
#   1. the GPU-only tests (tests/test_gpu.py): no synchronizing CUDA call between logging intervals
#      (torch.cuda.set_sync_debug_mode), CUDA-event timing, MFU and peak memory in throughput.json,
#      FSDP2 on one GPU (training, and validating on NCCL as configs/fsdp2.yaml sets it), and GPT-2
#      124M's peak memory against the README guide's estimate; their
#      output goes to gpu_tests.txt, and a failure does not stop the benchmarks;
#   2. `gpt-lightning bench` on the reference experiment (configs/gpt2-124m.yaml, 100 steps):
#      eager, whole-model compile and regional compile, each in a fresh process with an empty
#      compile cache, then the fast config (configs/gpt2-124m-fast.yaml);
#   3. bench.json and bench.png copied to $OUT/<GPU name>/ (default benchmarks/results/<GPU name>/);
#   4. the generation benchmark (benchmarks/generation.py: KV-cache generate, eager and compiled,
#      against the uncached path and, where transformers is installed, its generate) and a HellaSwag
#      pass (benchmarks/hellaswag.py, batched vs per example, bf16 autocast, on examples it writes
#      itself; HELLASWAG_FILE=path/to/hellaswag_val.jsonl scores the real ones), into the same folder;
#   5. AdamW against Muon, 5b. GPT-2 against the modern GPT (both with Muon), and 6. our Trainer loop
#      against a plain loop (Lightning's cost), all at the reference shape;
#   7. the GPU path's checks (benchmarks/gpu_checks.py, issue 35) at the reference shape: 8 accumulated
#      micro-batches a step under eager and each compile mode (losses within bf16 tolerance of eager's,
#      or the one-line refusal of the CUDA-graph modes), 20 steps with torch.cuda.set_sync_debug_mode
#      ("error") (zero host syncs), Muon's peak memory against AdamW's, greedy sampling in bf16 against
#      float32; into gpu_checks.json. The bf16 eager-vs-compiled loss check is bench's (2., bench.json).
#
# --dry-run (or GPU_RUN_SMOKE=1) runs every step on the CPU with tiny shapes (tests/test_gpu_run.py).
# On a GPU machine without network, carry .device-wheels/ (made by benchmarks/fetch_device_wheels.sh)
# along: what is missing (jsonargparse, pytest) is installed from it into
# .device-site/. GPU_RUN_SMOKE=1 runs the same steps on a CPU with a tiny model (tests/test_gpu_run.py).
#
# GPU_RUN_STEPS="bench overhead" runs only the steps named (tests bench generation hellaswag
# optimizers architectures overhead checks; default all), for a device lent for minutes.
set -euo pipefail
steps=" ${GPU_RUN_STEPS:-tests bench generation hellaswag optimizers architectures overhead checks} "
want() { [[ "$steps" == *" $1 "* ]]; }
if [ "${1:-}" = "--dry-run" ]; then
    export GPU_RUN_SMOKE=1
elif [ -n "${1:-}" ]; then
    echo "gpu_run.sh: unknown argument $1 (the only one is --dry-run: every step on the CPU, tiny shapes)" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/.device-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! python3 -c "import jsonargparse, pytest" 2>/dev/null; then
    python3 -m pip install -q --no-index --find-links .device-wheels --target .device-site "jsonargparse[signatures]" pytest
fi

runs=(eager model blocks)
extra=(--every 10 --cold)
generation=(--compile --repeats 5)
hellaswag=(--examples 256 --batch_sizes 1 8 32)
if [ -n "${GPU_RUN_SMOKE:-}" ]; then  # the wiring, on a CPU, in seconds
    runs=(eager blocks)
    extra=(--every 1 --trainer.accelerator cpu --trainer.max_steps 3 --throughput.warmup_steps 1
           --model.n_layer 1 --model.n_head 2 --model.n_embd 32 --data.batch_size 2 --data.block_size 32)
    tiny=(--n_layer 1 --n_head 2 --n_embd 32 --repeats 1)
    generation=("${tiny[@]}" --block_size 32 --prompt_tokens 4 --new_tokens 6 --batch_sizes 1 2 --probe_mb 8)
    hellaswag=("${tiny[@]}" --examples 5 --batch_sizes 2)  # 5: the last batch is a partial one
fi
if [ -n "${HELLASWAG_FILE:-}" ]; then
    hellaswag+=(--data_file "$HELLASWAG_FILE")
fi
logs="$(mktemp -d)"
gpu="$(python3 -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tr ' /' '__')"
dest="${OUT:-benchmarks/results}/$gpu"
mkdir -p "$dest"
tests_status=0
if want tests; then
    python3 -m pytest -q -s -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$dest/gpu_tests.txt" || tests_status=$?
fi
if want bench; then
    python3 -m gpt_lightning bench --config configs/gpt2-124m.yaml --runs "${runs[@]}" --also configs/gpt2-124m-fast.yaml \
        --trainer.logger.init_args.save_dir "$logs" "${extra[@]}"
    cp "$logs"/bench/*/bench.json "$logs"/bench/*/bench.png "$dest/"
fi
want generation && python3 benchmarks/generation.py "${generation[@]}" --out "$dest/generation.json"
want hellaswag && python3 benchmarks/hellaswag.py "${hellaswag[@]}" --out "$dest/hellaswag.json"

# 5. AdamW against Muon at the reference shape (GPT-2 124M, B=16, T=1024, WSD), one lockstep pair:
#    validation loss against tokens and the time per step (benchmarks/optimizers.py, docs/optimizers.md).
optimizers=(--n_layer 12 --n_head 12 --n_embd 768 --batch_size 16 --block_size 1024 --steps 300 --warmup_steps 30
            --eval_every 25 --adamw_lrs 1.2e-3 --muon_lrs 0.02)
if [ -n "${GPU_RUN_SMOKE:-}" ]; then
    optimizers=(--n_layer 1 --n_head 2 --n_embd 32 --batch_size 2 --block_size 16 --steps 2 --warmup_steps 1
                --eval_every 1 --eval_batches 1 --adamw_lrs 1e-3 --muon_lrs 0.02)
fi
want optimizers && python3 benchmarks/optimizers.py "${optimizers[@]}" --out "$dest"

# 5b. GPT-2 against the modern GPT (configs/modern-124m-fineweb.yaml's switches and rates), both with
#     Muon, at the reference shape, one lockstep pair: tokens to GPT-2 + Muon's final validation loss
#     and the time per step (benchmarks/architectures.py, docs/modern.md).
architectures=(--preset configs/modern-124m-fineweb.yaml --n_layer 12 --n_head 12 --n_embd 768 --batch_size 16
               --block_size 1024 --steps 300 --warmup_steps 30 --eval_every 25)
if [ -n "${GPU_RUN_SMOKE:-}" ]; then
    architectures=(--preset configs/modern-124m-fineweb.yaml --n_layer 1 --n_head 2 --n_embd 32 --batch_size 2
                   --block_size 16 --steps 2 --warmup_steps 1 --eval_every 1 --eval_batches 1)
fi
want architectures && python3 benchmarks/architectures.py "${architectures[@]}" --groups "gpt2 muon" "modern muon" --gpt2_muon_lrs 0.02 \
    --gpt2_muon_adamw_lrs 1.2e-3 --modern_muon_lrs 0.02 --embedding_lrs 0.3 --head_lrs 0.002 --out "$dest"

# 6. Lightning's cost at the reference shape (GPT-2 124M, B=16, T=1024, bf16-mixed): our Trainer loop
#    against a plain PyTorch loop, eager and compiled, rotated rounds, with the host time of each
#    per-step piece (benchmarks/lightning_overhead.py, docs/benchmarks.md).
overhead=(--n_layer 12 --n_head 12 --n_embd 768 --batch_size 16 --block_size 1024 --steps 30 --rounds 2)
if [ -n "${GPU_RUN_SMOKE:-}" ]; then
    overhead=(--n_layer 1 --n_head 2 --n_embd 32 --batch_size 2 --block_size 32 --steps 8 --warmup 2 --rounds 2
              --log_every 5 --compile false)
fi
want overhead && python3 benchmarks/lightning_overhead.py "${overhead[@]}" --out "$dest/lightning_overhead.json"

# 7. The GPU path's checks (issue 35). max-autotune-no-cudagraphs is left out here: its autotuning at
#    this shape takes minutes of the run's 15 (GPU_CHECK_MODES="..." to choose).
checks=(--n_layer 12 --n_head 12 --n_embd 768 --batch_size 16 --block_size 1024 --micro_batches 8 --steps 3
        --quiet_steps 20 --sample_tokens 128 --modes ${GPU_CHECK_MODES:-eager default reduce-overhead max-autotune})
if [ -n "${GPU_RUN_SMOKE:-}" ]; then
    checks=(--n_layer 1 --n_head 2 --n_embd 32 --batch_size 2 --block_size 32 --micro_batches 2 --steps 2
            --quiet_steps 2 --sample_tokens 8 --modes eager --accelerator cpu)
fi
# Issue 35's other items: the Muon guarded step's peak memory and step time (benchmarks/optimizers.py,
# 5. above, and gpu_checks' memory figure) and eager bf16 against compiled (bench, 2. above).
checks_status=0
if want checks; then python3 benchmarks/gpu_checks.py "${checks[@]}" --out "$dest/gpu_checks.json" || checks_status=$?; fi

echo "results in $dest"
[ "$tests_status" -ne 0 ] || tests_status=$checks_status
exit "$tests_status"
