#!/usr/bin/env bash
# Runs ON the lent GPU machine: Nsight Compute over the decode kernels of the bench, one shape
# at a time (CANDLE_FLASH_BENCH_DECODE), so that a decode change can be judged by DRAM
# throughput, occupancy and stall reasons rather than by end-to-end time alone.
#
# Usage: bash scripts/profile/decode.sh [BxL ...]   (default: 8x8192 1x65536)
# Writes $OUT/ncu-decode.txt: per shape, a metric table of a few launches of each kernel and
# the full SpeedOfLight/Occupancy/WarpState sections of one decode launch. PyTorch's decode
# kernels for the same shapes: `ncu ... python3 scripts/profile/torch-decode.py B L`.
set -uo pipefail
# shellcheck source=scripts/profile/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(8x8192 1x65536)
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__registers_per_thread,launch__occupancy_limit_shared_mem,launch__occupancy_limit_registers,launch__occupancy_limit_warps,sm__cycles_active.avg,smsp__inst_executed.sum
# Where warps wait (percent of active warp cycles), to tell memory latency from issue limits.
for r in long_scoreboard short_scoreboard barrier membar wait lg_throttle mio_throttle math_pipe_throttle not_selected selected no_instruction branch_resolving dispatch_stall misc; do
  metrics+=,smsp__warps_issue_stalled_${r}_per_warp_active.pct
done
log=$OUT/ncu-decode.txt
: > "$log"
for shape in "${shapes[@]}"; do
  echo "### $shape: metrics of launches 30-37 (after the check call and warm-up)" >> "$log"
  CANDLE_FLASH_BENCH_DECODE=$shape ncu_to "$log" 240 \
    --kernel-name regex:flash_decode --launch-skip 30 --launch-count 2 --metrics "$metrics" \
    "$BIN/bench-attention" --decode-only
  echo "### $shape: sections of one decode launch" >> "$log"
  CANDLE_FLASH_BENCH_DECODE=$shape ncu_to "$log" 240 \
    --kernel-name regex:flash_decode_bf16 --launch-skip 20 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section SchedulerStats --section LaunchStats \
    "$BIN/bench-attention" --decode-only
done
wrote "$log"
