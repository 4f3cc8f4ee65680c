#!/usr/bin/env bash
# Set up, then generate with the embedded demo cascade (the first run builds the demo model family, ~6 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
default_prompt=$'import os\nimport sys\n\n\ndef main('
cascade generate --max-tokens 96 "${1:-$default_prompt}"
