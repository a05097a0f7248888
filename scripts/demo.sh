#!/usr/bin/env bash
# The main job: set up (if needed), train the checked math graph with SmolLM2-135M-Instruct on CPU, then print
# what each agent can do before and after (graphs/math/report.py, read from the run's trace store).
#   bash scripts/demo.sh [--set key=value ...]      (e.g. --set steps=4 for a shorter run)
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-demo,deepspeed,ui}" bash scripts/setup.sh
. .venv/bin/activate
export TOKENIZERS_PARALLELISM=false WEAVE_DISABLED=true
drmas-graph train graphs/math/demo.yaml "$@"
RUN_DIR=runs/math-demo
for arg in "$@"; do
  case "$arg" in run_dir=*) RUN_DIR="${arg#run_dir=}" ;; esac
done
python -m graphs.math.report "$RUN_DIR"
