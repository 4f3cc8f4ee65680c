#!/usr/bin/env bash
# Set up with the test extras, then run the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
. .venv/bin/activate
python -m pytest "$@"
