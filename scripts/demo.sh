#!/usr/bin/env bash
# The main job: set up (if needed), then train the math graph with SmolLM2-135M-Instruct on CPU.
#   bash scripts/demo.sh [--set key=value ...]      (e.g. --set steps=4 for a shorter run)
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-demo,deepspeed,ui}" bash scripts/setup.sh
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false WEAVE_DISABLED=true
drmas-graph train graphs/math/demo.yaml "$@"
