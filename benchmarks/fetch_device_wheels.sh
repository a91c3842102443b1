#!/usr/bin/env bash
# Download, on a machine with PyPI, the wheels benchmarks/gpu_run.sh needs on a GPU machine that has
# torch and lightning but no network: jsonargparse (with its signatures extra) and pytest with their
# dependencies (GPT-2's BPE files ship inside gpt_lightning itself). For that machine's Python
# (default 3.12), into .device-wheels/, which git ignores.
set -euo pipefail
cd "$(dirname "$0")/.."
python_version="${1:-3.12}"
rm -rf .device-wheels
download() { python3 -m pip download -q --only-binary=:all: --python-version "$python_version" \
    --platform manylinux2014_x86_64 --platform any -d .device-wheels "$@"; }
download "jsonargparse[signatures]>=4.27" "pytest>=7"
# WITH_TRANSFORMERS=1: transformers too (about 49 MB with its dependencies, numpy included; the
# carried tree must stay under the device's limit), so the decode benchmark has its contender.
[ -z "${WITH_TRANSFORMERS:-}" ] || download "transformers>=4.45"
ls .device-wheels
