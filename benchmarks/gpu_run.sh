#!/usr/bin/env bash
# The GPU run, for a device lent for minutes: every step under its own time limit, inside a deadline
# for the whole run, each writing its figures into $OUT/<GPU name>/ (default benchmarks/results/) the
# moment it ends. Steps, in the order the docs publish their figures:
#   bench         `gpt-lightning bench` on the reference experiment (configs/gpt2-124m.yaml, 100 steps):
#                 eager, whole-model and regional compile from cold compile caches, then
#                 configs/gpt2-124m-fast.yaml; bench.json and bench.png updated after each run;
#   levers        the step's levers a GPU's defaults leave off until measured (the chunked loss, cuDNN
#                 attention), each on against the defaults on configs/gpt2-124m-fast.yaml, 30 steps
#                 (benchmarks/levers.py): tokens/s, peak memory, the first 10 steps' losses: levers.json;
#   tests         the GPU-only tests (tests/test_gpu.py), their output in gpu_tests.txt;
#   generation    decode at batch 1 and 8 in bf16, eager and compiled (CUDA graphs), against
#                 transformers' generate (dynamic and static cache) on the same weights, from a
#                 tiny Shakespeare prompt (benchmarks/generation.py): generation.json;
#   checks        benchmarks/gpu_checks.py: accumulation under compile, 20 steps without a host sync,
#                 Muon's peak memory, bf16 sampling against float32 on the GPU: gpu_checks.json;
#   overhead_eager, overhead_compiled   Lightning's cost: our Trainer loop against a plain loop, eager
#                 (lightning_overhead.json), then compiled (lightning_overhead_compiled.json);
#   fineweb       the FineWeb recipe's micro-batch (B=64, T=1024) through bench: configs/gpt2-124m.yaml
#                 with configs/gpt2-124m-fineweb.yaml's model flags, one micro-batch a step (its shards
#                 are not needed to time a step): fineweb-b64/bench.json;
#   autotune      --model.compile_mode max-autotune through bench twice, sharing one cache: the first
#                 pays the autotuning (autotune-cold/), the second is the figure from a warm cache
#                 (autotune/); each bench.json has compile_time_s;
#   hellaswag     batched vs per-example HellaSwag scoring (hellaswag.json).
# status.txt gets one line per step as it ends: done, failed (exit code), timed out, skipped for time.
# A failing step never stops the next; the run exits 1 if any step did not end "done".
# One compile cache serves the whole run (TORCHINDUCTOR_CACHE_DIR, default a fresh temporary folder);
# bench's cold runs compile into caches of their own and merge them into it afterwards.
#
# Knobs: GPU_RUN_DEADLINE (seconds for the whole run, default 480), GPU_RUN_LIMIT_<step>=seconds (one
# step's limit), GPU_RUN_STEPS="bench checks autotune_warm" (only those steps; "autotune": both), GPU_CHECK_MODES (gpu_checks' compile
# modes), HELLASWAG_FILE (real HellaSwag examples). --dry-run (or GPU_RUN_SMOKE=1): every step on the
# CPU with tiny shapes, under the same deadline and status logic (tests/test_gpu_run.py).
# On a GPU machine without network, carry .device-wheels/ (benchmarks/fetch_device_wheels.sh) along:
# what is missing (jsonargparse, pytest) is installed from it into .device-site/.
set -uo pipefail  # no -e: one failing step must not stop the others
start=$(date +%s)
steps=" ${GPU_RUN_STEPS:-bench levers tests generation checks overhead fineweb autotune hellaswag} "
want() { [[ "$steps" == *" $1 "* ]]; }
if [ "${1:-}" = "--dry-run" ]; then
    export GPU_RUN_SMOKE=1
elif [ -n "${1:-}" ]; then
    echo "gpu_run.sh: unknown argument $1 (the only one is --dry-run: every step on the CPU, tiny shapes)" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
# The CPU rehearsal tests the wiring, whatever the machine's load: a longer deadline, limits of 900 s.
deadline=$((start + ${GPU_RUN_DEADLINE:-$([ -n "${GPU_RUN_SMOKE:-}" ] && echo 1800 || echo 480)}))
export PYTHONPATH="$PWD/.device-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! python3 -c "import jsonargparse, pytest" 2>/dev/null; then
    python3 -m pip install -q --no-index --find-links .device-wheels --target .device-site "jsonargparse[signatures]" pytest
fi
if ! python3 -c "import transformers" 2>/dev/null && ls .device-wheels/transformers-* >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --find-links .device-wheels --target .device-site transformers ||
        echo "gpu_run: transformers did not install: the decode benchmark times ours only"
fi
gpu="$(python3 -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')" | tr ' /' '__')"
dest="${OUT:-benchmarks/results}/$gpu"
mkdir -p "$dest/logs"
status_file="$dest/status.txt"
: > "$status_file"
scratch="$(mktemp -d)"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$scratch/inductor}" TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$scratch/triton}"
failures=0

# step NAME LIMIT NEED COMMAND...: COMMAND under `timeout` (LIMIT seconds, GPU_RUN_LIMIT_NAME overrides,
# cut to the time left), skipped when fewer than NEED (at most LIMIT) seconds are left; its output in
# logs/NAME.txt (STEP_LOG=file instead). GPU_RUN_STEPS names a step, or all whose NAME starts "it_".
step() {
    local name=$1 limit=$2 need=$3 line rc began left knob="GPU_RUN_LIMIT_$1" log="$dest/${STEP_LOG:-logs/$1.txt}"
    shift 3
    want "$name" || want "${name%%_*}" || return 0
    [ -z "${GPU_RUN_SMOKE:-}" ] || limit=900
    limit=${!knob:-$limit}
    [ "$need" -le "$limit" ] || need=$limit
    left=$((deadline - $(date +%s)))
    if [ "$left" -lt "$need" ] || [ "$left" -le 0 ]; then
        line="$name: skipped for time (${left}s left, needs ${need}s)"
    else
        [ "$limit" -le "$left" ] || limit=$left
        began=$(date +%s)
        echo "gpu_run: $name (limit ${limit}s, ${left}s left): $*"
        { timeout -k 10 "$limit" "$@"; echo $? > "$scratch/rc"; } 2>&1 | tee "$log"
        rc=$(cat "$scratch/rc")
        case $rc in
            0) line="$name: done in $(($(date +%s) - began))s" ;;
            124|137) line="$name: timed out after ${limit}s" ;;
            *) line="$name: failed with exit code $rc after $(($(date +%s) - began))s" ;;
        esac
    fi
    [[ "$line" == *": done"* ]] || failures=$((failures + 1))
    echo "gpu_run: $line"
    echo "$line" >> "$status_file"
}

bench=(--config configs/gpt2-124m.yaml --trainer.logger.init_args.save_dir "$scratch/logs" --every 10)
runs=(eager model blocks)
also=(--also configs/gpt2-124m-fast.yaml)
# The fast config is the reference shape with the module's defaults: its graphs are warm from bench.
levers=(--config configs/gpt2-124m-fast.yaml --trainer.logger.init_args.save_dir "$scratch/logs" --trainer.max_steps 30
        --throughput.warmup_steps 10)
cold=(--cold)
extra=()
generation=(--dtype bfloat16 --compile --transformers_static --batch_sizes 1 8 --repeats 3 --new_tokens 256
            --uncached_batch_sizes)
hellaswag=(--examples 256 --batch_sizes 1 8 32)
overhead=(--n_layer 12 --n_head 12 --n_embd 768 --batch_size 16 --block_size 1024 --steps 30 --rounds 2)
# max-autotune-no-cudagraphs is left out: its autotuning at this shape takes minutes (GPU_CHECK_MODES to choose).
checks=(--n_layer 12 --n_head 12 --n_embd 768 --batch_size 16 --block_size 1024 --micro_batches 8 --steps 3
        --quiet_steps 20 --sample_tokens 128 --modes ${GPU_CHECK_MODES:-eager default reduce-overhead max-autotune})
fineweb=(--model.vocab_size 50304 --model.learning_rate 6e-4 --model.weight_decay 0.1 --model.betas "[0.9, 0.95]"
         --model.compile_scope blocks --data.batch_size 64 --trainer.max_steps 30 --throughput.warmup_steps 10)
autotune=(--model.compile_mode max-autotune --trainer.max_steps 50)
autotune_env=()
tests=(tests/test_gpu.py)
if [ -n "${GPU_RUN_SMOKE:-}" ]; then  # the wiring, on a CPU, in seconds
    runs=(eager blocks)
    cold=()  # bench's --cold is test_bench's; here the Block graph compiles once, for blocks, fast and fineweb
    tiny=(--n_layer 1 --n_head 2 --n_embd 32)
    extra=(--every 1 --trainer.accelerator cpu --trainer.max_steps 3 --throughput.warmup_steps 1
           --model.n_layer 1 --model.n_head 2 --model.n_embd 32 --data.batch_size 2 --data.block_size 32)
    # bench's tiny shapes without its own --every 1; eager, the three runs in one process: the wiring, in seconds
    levers=(--config configs/gpt2-124m-fast.yaml --trainer.logger.init_args.save_dir "$scratch/logs"
            "${extra[@]:2}" --model.compile false --in_process)
    generation=("${tiny[@]}" --dtype bfloat16 --repeats 1 --block_size 32 --prompt_tokens 4 --new_tokens 6 --batch_sizes 1 2 --probe_mb 8
                --compile --transformers_static)
    hellaswag=("${tiny[@]}" --repeats 1 --examples 5 --batch_sizes 2)  # 5: the last batch is a partial one
    overhead=("${tiny[@]}" --batch_size 2 --block_size 32 --steps 8 --warmup 2 --rounds 2 --log_every 5)
    checks=("${tiny[@]}" --batch_size 2 --block_size 32 --micro_batches 2 --steps 2 --quiet_steps 2 --sample_tokens 8
            --modes eager --accelerator cpu)
    fineweb=(--model.vocab_size 50304 --model.compile_scope blocks --trainer.max_steps 2)
    autotune=(--model.compile_mode max-autotune --trainer.max_steps 2)
    # the mode's wiring without a CPU's template tuning (the autotune steps', and generation's batch-1 CPU decode step)
    autotune_env=(TORCHINDUCTOR_MAX_AUTOTUNE_GEMM_BACKENDS=ATEN)
fi
[ -z "${HELLASWAG_FILE:-}" ] || hellaswag+=(--data_file "$HELLASWAG_FILE")

step bench 240 30 python3 -m gpt_lightning bench "${bench[@]}" --runs "${runs[@]}" "${also[@]}" "${cold[@]}" --out "$dest" "${extra[@]}"
step levers 180 60 python3 benchmarks/levers.py "${levers[@]}" --out "$dest/levers.json"
STEP_LOG=gpu_tests.txt step tests 150 30 python3 -m pytest -q -s -p no:cacheprovider "${tests[@]}"
step generation 180 30 env "${autotune_env[@]}" python3 benchmarks/generation.py "${generation[@]}" --out "$dest/generation.json"
step checks 150 30 python3 benchmarks/gpu_checks.py "${checks[@]}" --out "$dest/gpu_checks.json"
step overhead_eager 150 30 python3 benchmarks/lightning_overhead.py "${overhead[@]}" --compile false --out "$dest/lightning_overhead.json"
step overhead_compiled 150 60 python3 benchmarks/lightning_overhead.py "${overhead[@]}" --compile true \
    --out "$dest/lightning_overhead_compiled.json"
step fineweb 90 30 python3 -m gpt_lightning bench "${bench[@]}" --runs blocks --out "$dest/fineweb-b64" "${extra[@]}" "${fineweb[@]}"
step autotune_cold 240 60 env "${autotune_env[@]}" python3 -m gpt_lightning bench "${bench[@]}" --runs model --out "$dest/autotune-cold" "${extra[@]}" "${autotune[@]}"
step autotune_warm 120 30 env "${autotune_env[@]}" python3 -m gpt_lightning bench "${bench[@]}" --runs model --out "$dest/autotune" "${extra[@]}" "${autotune[@]}"
step hellaswag 60 20 python3 benchmarks/hellaswag.py "${hellaswag[@]}" --out "$dest/hellaswag.json"

rm -rf "$scratch"
echo "results in $dest ($(($(date +%s) - start))s):"
cat "$status_file"
[ "$failures" -eq 0 ]
