#!/usr/bin/env bash
# Create .venv and install Cascade into it (with the extras named as arguments, e.g. `test`).
# PyTorch is installed only if the venv has none: bring your own ROCm/CUDA build by installing it first, or set
# CASCADE_TORCH to the requirement to use (default: the CPU build torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "${CASCADE_TORCH:-torch==2.13.0}"
fi
extras=$(IFS=,; echo "$*")
python -m pip install -q -e ".${extras:+[$extras]}"
