#!/usr/bin/env bash
# Runs ON the lent GPU machine: per-instruction (SASS) stall samples of one of our kernels on
# the sm_80 path and of PyTorch's FlashAttention-2 counterpart, for one bench shape, as CSV:
# which instructions the warps wait on, side by side.
#
# Usage: bash scripts/profile-sass.sh fwd|bwd HD/SEQLEN/c|n
# Writes $OUT/sass-ours-PASS.csv and $OUT/sass-fa2-PASS.csv.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-./out}
mkdir -p "$OUT"
# shellcheck source=scripts/staged-bin.sh
source scripts/staged-bin.sh
staged_bin bench-attention || exit 1
pass=$1 case=$2
IFS=/ read -r hd seqlen causal <<< "$case"
if [ "$pass" = fwd ]; then ours='flash_fwd_'; theirs='flash_fwd_kernel'
else ours='flash_bwd_dkdvq'; theirs='flash_bwd_dq_dk_dv'; fi
opts=(--clock-control none --section SourceCounters --page source --print-source sass --csv
  --launch-count 1)
CANDLE_FLASH_ARCH=sm80 CANDLE_FLASH_BENCH_CASES=$case timeout 200 ncu "${opts[@]}" \
  --kernel-name regex:"$ours" --launch-skip 4 "$BIN/bench-attention" --no-decode --no-naive \
  > "$OUT/sass-ours-$pass.csv" 2> "$OUT/sass-ours-$pass.err"
timeout 200 ncu "${opts[@]}" --kernel-name regex:"$theirs" --launch-skip 2 \
  python3 scripts/profile_fa2.py "$hd" "$seqlen" "$causal" \
  > "$OUT/sass-fa2-$pass.csv" 2> "$OUT/sass-fa2-$pass.err"
wc -l "$OUT"/sass-*-"$pass".csv
