#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-dev,demo,deepspeed}" bash scripts/setup.sh
. .venv/bin/activate
export WEAVE_DISABLED=true TOKENIZERS_PARALLELISM=false
python -m pytest -q "$@"
