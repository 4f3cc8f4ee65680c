#!/usr/bin/env bash
# The one prepared GPU check, in one go (needs a CUDA or ROCm build of PyTorch):
#  1. compile the native kernels for this GPU, run every kernel test on it (Triton compiled for the GPU, the native
#     kernels against the reference), then the kernel benchmark (bandwidth table);
#  2. the GPU-marked engine tests (device-resident rounds through the kernels);
#  3. end to end: the demo family on the GPU in float32 and bfloat16 through `cascade bench --quick`, greedy then
#     T=0.8, with the speed-ups and the greedy mismatch classification (numerical near-ties vs failures).
# Results go to $OUT if set (else the current directory). A machine without the package's dependencies installs
# wheels found under .gpu/wheels; the demo family is read from $XDG_CACHE_HOME/cascade/zoo/demo (carry it, e.g.
# XDG_CACHE_HOME=.gpu/cache, or it is built there, which takes minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
export PYTHONUNBUFFERED=1
# The Python that holds the CUDA/ROCm torch: $PYTHON, else `python`, else `python3` (some GPU images have only that).
python() { "${PYTHON:-$(type -P python || type -P python3)}" "$@"; }
if ls .gpu/wheels/*.whl >/dev/null 2>&1; then
    python -m pip install -q --no-index --no-deps .gpu/wheels/*.whl 2>&1 | tail -3 || true
fi
python -c "import torch; assert torch.cuda.is_available(), 'no GPU'; print(torch.cuda.get_device_name(0), torch.__version__)"

python -m cascade.cli kernels build
failed=0  # a failing step is reported and the next one still runs: one lease should show everything
python -m pytest -q -p no:cacheprovider tests/test_ops.py 2>&1 | tee "$out/kernel-tests.txt" || failed=1
python -m cascade.cli kernels bench 2>&1 | tee "$out/kernel-bench.txt" || failed=1
python -m pytest -q -p no:cacheprovider -m gpu tests/test_device_resident.py 2>&1 | tee "$out/engine-gpu-tests.txt" || failed=1

e2e="$out/e2e.txt"
: > "$e2e"
for dtype in float32 bfloat16; do
    config="$(mktemp --suffix=.yaml)"
    python - "$dtype" "$config" <<'EOF'
import sys
import yaml
from cascade.config import packaged_config_path
dtype, path = sys.argv[1], sys.argv[2]
config = yaml.safe_load(packaged_config_path("demo").read_text())
for stage in config["stages"]:
    if stage.get("type") == "hf":
        stage.update(device="cuda", dtype=dtype)
open(path, "w").write(yaml.safe_dump(config))
EOF
    for temperature in 0 0.8; do
        echo "== demo family on $(python -c 'import torch; print(torch.cuda.get_device_name(0))'), $dtype, T=$temperature" | tee -a "$e2e"
        # exit status 1 means a greedy failure (not a near-tie): keep going and report it
        python -m cascade.cli bench --config "$config" --quick --temperature "$temperature" \
            --out "$(mktemp -d)" 2>&1 | tee -a "$e2e" || { echo "cascade bench exited with $?" | tee -a "$e2e"; failed=1; }
    done
done
exit "$failed"
