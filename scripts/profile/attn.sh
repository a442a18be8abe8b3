#!/usr/bin/env bash
# Runs ON the lent GPU machine: Nsight Compute over one launch of each of our attention
# kernels (forward, dK/dV, dQ) for the bench cases given, to see what limits them (tensor-pipe
# use, stalls, occupancy) before changing tile shapes.
#
# Usage: bash scripts/profile/attn.sh [HD/SEQLEN/c|n ...]   (default: 128/8192/n 64/2048/n)
# Writes $OUT/ncu-attn.txt.
set -uo pipefail
# shellcheck source=scripts/profile/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(128/8192/n 64/2048/n)
log=$OUT/ncu-attn.txt
: > "$log"
for c in "${cases[@]}"; do
  echo "### $c" >> "$log"
  # Launch 5 of each kernel: past the correctness check and the first warm-up calls.
  CANDLE_FLASH_BENCH_CASES=$c ncu_to "$log" 200 \
    --kernel-name regex:'flash_(fwd|bwd_dkdv|bwd_dq)' --launch-skip 5 --launch-count 3 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
    --section ComputeWorkloadAnalysis --section LaunchStats \
    "$BIN/bench-attention" --no-decode
done
wrote "$log"
