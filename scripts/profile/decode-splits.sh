#!/usr/bin/env bash
# Runs ON the lent GPU machine: the decode split count and block width forced
# (CANDLE_FLASH_DECODE_SPLITS / _WARPS), swept over the bench's decode shapes (graph rows) and
# the LLaMA example's CUDA-graph step at the 1B shape (hd 64, 8 K/V heads, prompt 512), beside
# the planner's own choice: the data for the decode split heuristic (src/cuda/plan/decode.rs).
#
# Usage: bash scripts/profile/decode-splits.sh [SPLITS ...]   (default: 1 2 4 8 16 32 64)
# SHAPES=BxL,... picks the bench's shapes (default 1x8192,8x8192); SHAPES= skips the bench.
# Writes $OUT/decode-splits.txt.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
# shellcheck source=scripts/gpu/staged-bin.sh
source scripts/gpu/staged-bin.sh
staged_bin bench-attention || exit 1
splits=("$@")
[ ${#splits[@]} -gt 0 ] || splits=(1 2 4 8 16 32 64)
log=$OUT/decode-splits.txt
: > "$log"
# One configuration: ENV... as `VAR=value` words. Prints the bench's graph rows (L, batch, ms,
# %copy) and the example's ms/step and % of the weight-read roofline at batch 1 and 16.
config() {
  local rows="" b1="" b16=""
  [ "${SHAPES-x}" = "" ] ||
    rows=$(env "$@" CANDLE_FLASH_BENCH_DECODE=${SHAPES:-1x8192,8x8192} timeout 60 "$BIN/bench-attention" --decode-only 2>&1 |
      awk '$2 == "graph" {printf "%sx%s %s ms %s%%; ", $5, $4, $8, $10}')
  for b in 1 16; do
    # The sweep's table row: | batch | setting | ms/step | % of roofline |
    r=$(NEW=48 REPEAT=2 timeout 120 bash scripts/model/llama-env-sweep.sh "$b" "$*" 2> /tmp/llama-splits.err |
      awk -F'|' -v b="$b" '$2 == " " b " " {gsub(/ /, "", $4); gsub(/ /, "", $5); print $4 " ms " $5}')
    [ -n "$r" ] || r="failed: $(tail -n 1 /tmp/llama-splits.err)"
    [ "$b" = 1 ] && b1=$r || b16=$r
  done
  echo "$* | bench graph: $rows| llama b1: $b1 | b16: $b16" | tee -a "$log"
}
config CANDLE_FLASH_DECODE_PLANNER=1
for n in "${splits[@]}"; do config CANDLE_FLASH_DECODE_SPLITS="$n"; done
for n in "${splits[@]}"; do config CANDLE_FLASH_DECODE_SPLITS="$n" CANDLE_FLASH_DECODE_WARPS=4; done
echo "wrote $log"
