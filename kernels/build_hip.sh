#!/usr/bin/env bash
# Compile the verification kernels into real AMD code objects with hipcc alone (no PyTorch, no GPU needed):
#   bash kernels/build_hip.sh [OUT_DIR] [ARCH...]     default archs: gfx90a (MI200) gfx940 (MI300)
# Fails on any error or warning. Debian's hipcc 5.2 knows gfx940 but not gfx942.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:-${TMPDIR:-/tmp}/cascade-hip}"
shift || true
archs=("${@:-gfx90a gfx940}")
read -r -a archs <<< "${archs[*]}"
mkdir -p "$out"
flags=()
for a in "${archs[@]}"; do flags+=("--offload-arch=$a"); done
scratch="$(mktemp -d)"  # the compiler's intermediate files: hipcc leaves empty directories behind in TMPDIR
trap 'rm -rf "$scratch"' EXIT
TMPDIR="$scratch" HIP_PLATFORM=amd hipcc -x hip "${flags[@]}" -O3 -Wall -Wextra -Werror -fPIC -shared \
  "$here/verify_kernels.cu" -o "$out/libcascade_verify.so"
echo "$out/libcascade_verify.so"
