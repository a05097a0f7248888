#!/usr/bin/env bash
# The property suite's long hunt: run tests/property again and again with fresh random seeds for MINUTES
# (default 30), each round with the 'hunt' profile (random, not derandomized), until one fails or time is up.
#   bash scripts/property_hunt.sh [MINUTES]       (log: runs/property-hunt/hunt.log, one line per round)
# A failure stops the hunt and leaves Hypothesis's shrunk app and its @reproduce_failure blob in the round's log.
# The checkout it lives in is the package tested (PYTHONPATH); PYTHON runs it, else the python of the checkout's
# .venv, else (a git worktree) that of the main checkout's .venv.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${PYTHON:-}" ]]; then
  common="$(git rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true)"
  for venv in .venv "${common%/.git}/.venv"; do
    if [[ -x "$venv/bin/python" ]]; then PYTHON="$venv/bin/python"; break; fi
  done
fi
PYTHON="${PYTHON:-python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" WEAVE_DISABLED="${WEAVE_DISABLED:-true}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
MINUTES="${1:-30}"
OUT="${HUNT_DIR:-runs/property-hunt}"
mkdir -p "$OUT"
start=$(date +%s)
round=0
apps=0
echo "hunt start $(date -u +%FT%TZ), ${MINUTES} min" | tee -a "$OUT/hunt.log"
while (( $(date +%s) - start < MINUTES * 60 )); do
  round=$((round + 1))
  seed=$("$PYTHON" -c "import random; print(random.SystemRandom().randrange(2**32))")
  log="$OUT/round-$round.log"
  "$PYTHON" -m pytest tests/property -q -x -p no:cacheprovider --hypothesis-profile=hunt --hypothesis-seed="$seed" \
    --hypothesis-show-statistics > "$log" 2>&1
  rc=$?
  # every test's statistics say "- N passing, M failing, and K invalid test cases"
  n=$(grep -oE "[0-9]+ passing," "$log" | awk '{s += $1} END {print s + 0}')
  apps=$((apps + n))
  echo "round $round seed $seed rc $rc apps $n total $apps elapsed $(( $(date +%s) - start ))s" | tee -a "$OUT/hunt.log"
  if (( rc != 0 )); then
    echo "FAILED: see $log ($PYTHON -m pytest tests/property --hypothesis-seed=$seed --hypothesis-profile=hunt)" \
      | tee -a "$OUT/hunt.log"
    exit 1
  fi
done
echo "hunt end: $round rounds, $apps generated apps, no failure, $(( $(date +%s) - start ))s" | tee -a "$OUT/hunt.log"
