#!/usr/bin/env bash
# The prepared GPU check for the verification kernels, in one go (needs a CUDA or ROCm build of PyTorch):
# compile the native kernels for this GPU, run every kernel test on it (Triton compiled for the GPU, the native
# kernels bit for bit against the reference), then the kernel benchmark. Results also go to $OUT if set.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
python -c "import torch; assert torch.cuda.is_available(), 'no GPU'; print(torch.cuda.get_device_name(0))"
python -m cascade.cli kernels build
python -m pytest -q tests/test_ops.py 2>&1 | tee "$out/kernel-tests.txt"
python -m cascade.cli kernels bench 2>&1 | tee "$out/kernel-bench.txt"
