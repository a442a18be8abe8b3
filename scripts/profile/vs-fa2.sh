#!/usr/bin/env bash
# Runs ON the lent GPU machine: Nsight Compute over our forward and fused backward on the
# sm_80 path (CANDLE_FLASH_ARCH=sm80) and over PyTorch's FlashAttention-2 kernels (the same
# mma.sync generation) for the bench shapes given, so that the two can be compared counter by
# counter: registers, shared-memory wavefronts and bank conflicts, issue slots, stalls.
#
# Usage: bash scripts/profile/vs-fa2.sh [--sass] [HD/SEQLEN/c|n ...]   (default: 128/4096/n)
#   --sass  per-instruction (SASS) stall samples and counts instead of the section counters,
#           one CSV per (case, pass, side): which instructions the warps wait on
# Environment: PASSES (default "fwd bwd").
# Writes $OUT/ncu-vs-fa2.txt, or with --sass $OUT/sass-{ours,fa2}-PASS-HD-SEQLEN-C.csv.
set -uo pipefail
# shellcheck source=scripts/profile/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
SASS=0
if [ "${1:-}" = --sass ]; then SASS=1; shift; fi
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(128/4096/n)
if [ "$SASS" = 1 ]; then
  opts=(--section SourceCounters --page source --print-source sass --csv)
else
  opts=(--section SpeedOfLight --section LaunchStats --section Occupancy
    --section WarpStateStats --section InstructionStats --section SchedulerStats
    --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables
    --section SourceCounters --print-details all)
  log=$OUT/ncu-vs-fa2.txt
  : > "$log"
fi
for c in "${cases[@]}"; do
  IFS=/ read -r hd seqlen causal <<< "$c"
  for pass in ${PASSES:-fwd bwd}; do
    if [ "$pass" = fwd ]; then ours='flash_fwd_'; theirs='flash_fwd_kernel'
    else ours='flash_bwd_dkdvq'; theirs='flash_bwd_dq_dk_dv'; fi
    if [ "$SASS" = 1 ]; then
      tag=$pass-$hd-$seqlen-$causal
      out_ours=$OUT/sass-ours-$tag.csv out_fa2=$OUT/sass-fa2-$tag.csv
      : > "$out_ours"
      : > "$out_fa2"
    else
      out_ours=$log out_fa2=$log
      echo "### $c $pass ours (sm80 path)" >> "$log"
    fi
    CANDLE_FLASH_ARCH=sm80 CANDLE_FLASH_BENCH_CASES=$c ncu_to "$out_ours" 150 \
      --kernel-name regex:"$ours" --launch-skip 4 --launch-count 1 "${opts[@]}" \
      "$BIN/bench-attention" --no-decode --no-naive
    [ "$SASS" = 1 ] || echo "### $c $pass FA2 (PyTorch)" >> "$log"
    ncu_to "$out_fa2" 150 --kernel-name regex:"$theirs" --launch-skip 2 --launch-count 1 \
      "${opts[@]}" python3 scripts/profile/fa2.py "$hd" "$seqlen" "$causal"
  done
done
if [ "$SASS" = 1 ]; then wc -l "$OUT"/sass-*.csv; else wrote "$log"; fi
