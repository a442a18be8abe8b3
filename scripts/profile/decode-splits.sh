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
staged_bin example-llama || exit 1
splits=("$@")
[ ${#splits[@]} -gt 0 ] || splits=(1 2 4 8 16 32 64)
log=$OUT/decode-splits.txt
: > "$log"
d=/tmp/llama-hf/llama-3.2-1b-random
python3 -c "import sys; sys.path.insert(0, 'scripts/model'); import llama_hf; llama_hf.make_1b('$d')" > /dev/null 2>&1
# One configuration: ENV... as `VAR=value` words. Prints the bench's graph rows (L, batch, ms,
# %copy) and the example's ms/step and % of the weight-read roofline at batch 1 and 16.
config() {
  local rows="" b1="" b16=""
  [ "${SHAPES-x}" = "" ] ||
    rows=$(env "$@" CANDLE_FLASH_BENCH_DECODE=${SHAPES:-1x8192,8x8192} timeout 60 "$BIN/bench-attention" --decode-only 2>&1 |
      awk '$2 == "graph" {printf "%sx%s %s ms %s%%; ", $5, $4, $8, $10}')
  for b in 1 16; do
    r=$(env "$@" timeout 60 "$BIN/example-llama" --model "$d" --device cuda --dtype bf16 --random-prompt 512 \
      --batch "$b" --max-new-tokens 48 --ignore-eos --quiet --stats-json --warmup --roofline --repeat 2 2> /tmp/llama-splits.err |
      tail -n 1 | python3 -c 'import json, sys; r = json.loads(sys.stdin.read()); print("%.3f ms %.0f%%" % (r["decode_ms_per_step"], r.get("roofline_pct", 0)))' 2> /dev/null)
    [ -n "$r" ] || r="failed: $(tail -n 1 /tmp/llama-splits.err)"
    [ "$b" = 1 ] && b1=$r || b16=$r
  done
  echo "$* | bench graph: $rows| llama b1: $b1 | b16: $b16" | tee -a "$log"
}
config CANDLE_FLASH_DECODE_PLANNER=1
for n in "${splits[@]}"; do config CANDLE_FLASH_DECODE_SPLITS="$n"; done
for n in "${splits[@]}"; do config CANDLE_FLASH_DECODE_SPLITS="$n" CANDLE_FLASH_DECODE_WARPS=4; done
echo "wrote $log"
