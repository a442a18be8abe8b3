#!/usr/bin/env bash
# Runs ON the lent GPU: the bench grid (no decode, no naive rows) with released candle-core
# and with docs/upstream/candle-core-first-grad.patch, alternated ROUNDS times
# (scripts/bench/ab.sh: logs, medians), then scripts/bench/autograd_table.py over the two.
# Needs .gpu/bench-attention.xz (scripts/gpu/stage.sh) and .gpu/bench-attention-patched.xz
# (`bash scripts/bench/candle-patched.sh --stage bench:attention`).
# Usage: OUT=$OUT bash scripts/bench/autograd-ab.sh [ROUNDS] [bench args...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-./out}
export OUT
ROUNDS=${1:-2}
shift || true
args="--no-decode --no-naive --json {json} $*"
AB_PASSES=fwd+bwd bash scripts/bench/ab.sh "$ROUNDS" \
  "released=\$BIN/bench-attention $args" "patched=\$BIN/bench-attention-patched $args"
python3 scripts/bench/autograd_table.py released="$OUT/released.json" patched="$OUT/patched.json" \
  | tee "$OUT/autograd.md"
grep "autograd bookkeeping" "$OUT/released.log" | head -n 12 || true
