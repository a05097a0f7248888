#!/usr/bin/env bash
# Serve SmolLM2-135M-Instruct as the helpdesk judge: vLLM on the CPU, with guided decoding (xgrammar), so every
# reply is the judge's JSON (the embedded 135M judge without it never answers in the format). Runs in the
# foreground until Ctrl-C; in another shell:
#     drmas-graph train graphs/helpdesk/train_vllm_judge.yaml
# Needs the vLLM environment (scripts/setup_vllm.sh; its python in $DRMAS_VLLM_PYTHON, else ./.venv-vllm) and
# drmas_graph importable by `python` (or $PYTHON) for the model's folder. PORT (8008) and any extra vLLM
# arguments: `PORT=8100 bash graphs/helpdesk/serve_judge.sh --max-num-seqs 4`.
# disable_any_whitespace: compact JSON; JSON allows whitespace between tokens and a small model emits it forever.
set -euo pipefail
cd "$(dirname "$0")/../.."
VLLM_PYTHON="${DRMAS_VLLM_PYTHON:-.venv-vllm/bin/python}"
PORT="${PORT:-8008}"
MODEL="$("${PYTHON:-python}" -c 'from drmas_graph.engine.models import smollm2_path; print(smollm2_path())')"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
exec "$VLLM_PYTHON" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name smollm2-judge \
  --host 127.0.0.1 --port "$PORT" --dtype float32 --max-model-len 8192 \
  --structured-outputs-config '{"backend": "xgrammar", "disable_any_whitespace": true}' "$@"
