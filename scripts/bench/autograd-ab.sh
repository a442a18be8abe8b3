#!/usr/bin/env bash
# Runs ON the lent GPU: the bench grid (no decode, no naive rows) with released candle-core
# and with docs/upstream/candle-core-first-grad.patch, alternated ROUNDS times, then per side
# the median of each record and scripts/bench/autograd_table.py over the two.
# Needs .gpu/bench-attention.xz (scripts/gpu/stage.sh) and .gpu/bench-attention-patched.xz
# (`bash scripts/bench/candle-patched.sh --stage bench:attention`).
# Usage: OUT=$OUT bash scripts/bench/autograd-ab.sh [ROUNDS] [bench args...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-./out}
ROUNDS=${1:-2}
shift || true
mkdir -p "$OUT"
source scripts/gpu/staged-bin.sh
staged_bin bench-attention
staged_bin bench-attention-patched
W=$(mktemp -d)
for r in $(seq "$ROUNDS"); do
  "$BIN/bench-attention" --no-decode --no-naive --json "$W/released$r.json" "$@" >> "$OUT/ab.log" 2>&1
  "$BIN/bench-attention-patched" --no-decode --no-naive --json "$W/patched$r.json" "$@" >> "$OUT/ab.log" 2>&1
done
python3 scripts/bench/median_json.py "$OUT/released.json" "$W"/released*.json
python3 scripts/bench/median_json.py "$OUT/patched.json" "$W"/patched*.json
python3 scripts/bench/autograd_table.py released="$OUT/released.json" patched="$OUT/patched.json" \
  | tee "$OUT/autograd.md"
grep "autograd bookkeeping" "$OUT/ab.log" | head -n 12 || true
