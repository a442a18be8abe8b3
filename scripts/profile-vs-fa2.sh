#!/usr/bin/env bash
# Runs ON the lent GPU machine: Nsight Compute over our forward and fused backward on the
# sm_80 path (CANDLE_FLASH_ARCH=sm80) and over PyTorch's FlashAttention-2 kernels (the same
# mma.sync generation) for one bench shape, so that the two can be compared counter by
# counter: registers, shared-memory wavefronts and bank conflicts, issue slots, stalls.
#
# Usage: bash scripts/profile-vs-fa2.sh [HD/SEQLEN/c|n ...]   (default: 128/4096/n)
# Writes $OUT/ncu-vs-fa2.txt.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
OUT=${OUT:-./out}
mkdir -p "$OUT"
# shellcheck source=scripts/staged-bin.sh
source scripts/staged-bin.sh
staged_bin bench-attention || exit 1
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(128/4096/n)
log=$OUT/ncu-vs-fa2.txt
: > "$log"
sections=(--section SpeedOfLight --section LaunchStats --section Occupancy
  --section WarpStateStats --section InstructionStats --section SchedulerStats
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables
  --section SourceCounters --print-details all)
for c in "${cases[@]}"; do
  IFS=/ read -r hd seqlen causal <<< "$c"
  for pass in ${PASSES:-fwd bwd}; do
    if [ "$pass" = fwd ]; then ours='flash_fwd_'; theirs='flash_fwd_kernel'
    else ours='flash_bwd_dkdvq'; theirs='flash_bwd_dq_dk_dv'; fi
    echo "### $c $pass ours (sm80 path)" >> "$log"
    CANDLE_FLASH_ARCH=sm80 CANDLE_FLASH_BENCH_CASES=$c timeout 150 ncu --clock-control none \
      --kernel-name regex:"$ours" --launch-skip 4 --launch-count 1 "${sections[@]}" \
      "$BIN/bench-attention" --no-decode --no-naive 2>&1 | grep -v "^==PROF==" >> "$log"
    echo "### $c $pass FA2 (PyTorch)" >> "$log"
    timeout 150 ncu --clock-control none --kernel-name regex:"$theirs" --launch-skip 2 \
      --launch-count 1 "${sections[@]}" python3 scripts/profile_fa2.py "$hd" "$seqlen" "$causal" \
      2>&1 | grep -v "^==PROF==" >> "$log"
  done
done
echo "wrote $log ($(wc -l < "$log") lines)"
