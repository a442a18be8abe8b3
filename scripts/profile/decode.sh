#!/usr/bin/env bash
# Runs ON the lent GPU machine: Nsight Compute over the decode kernels of the bench, one shape
# at a time (CANDLE_FLASH_BENCH_DECODE), so that a decode change can be judged by DRAM
# throughput, SM idle time and stall reasons rather than by end-to-end time alone.
#
# Usage: bash scripts/profile/decode.sh [--sass] [BxL ...]   (default: 8x8192 1x65536)
# Writes $OUT/ncu-decode.txt: per shape and cache (bf16, then e4m3), a metric table of three
# launches of the d 128 decode kernel (`sm__cycles_active` against `sm__cycles_elapsed` is the
# launch's SM idle share) and the warp-state and scheduler sections of one.
# --sass: also $OUT/ncu-decode-<shape>-<cache>.csv, one launch's per-SASS-line stall samples
# and executed instructions, summarised by scripts/profile/sass_hotspots.py (divide a line's
# executed count by the launch's warp tiles for its count a tile).
# PyTorch's decode kernels for the same shapes: `ncu ... python3 scripts/profile/torch-decode.py B L`.
set -uo pipefail
# shellcheck source=scripts/profile/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
SASS=0
shapes=()
for arg in "$@"; do
  case $arg in
    --sass) SASS=1 ;;
    *) shapes+=("$arg") ;;
  esac
done
[ ${#shapes[@]} -gt 0 ] || shapes=(8x8192 1x65536)
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__cycles_active.avg,sm__cycles_elapsed.avg,launch__grid_size,launch__registers_per_thread,smsp__inst_executed.sum,smsp__warps_active.avg.per_cycle_active
# Stall reasons as warps stalled per issued instruction (the per-warp-active percentages read
# n/a on this ncu).
stalls='regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio$'
# The bench's d 128 kernels (4- or 8-warp), bf16 cache then e4m3.
caches=("bf16:flash_decode_bf16_d128(_w8)?$" "e4m3:flash_decode_bf16_d128(_w8)?_fp8$")
log=$OUT/ncu-decode.txt
: > "$log"
for shape in "${shapes[@]}"; do
  for c in "${caches[@]}"; do
    name=${c%%:*} sel=(--kernel-name "regex:${c#*:}")
    echo "### $shape, $name cache: three launches after the warm-up" >> "$log"
    CANDLE_FLASH_BENCH_DECODE=$shape ncu_to "$log" 100 "${sel[@]}" --launch-skip 20 \
      --launch-count 3 --metrics "$metrics" "$BIN/bench-attention" --decode-only
    echo "### $shape, $name cache: sections of one launch" >> "$log"
    CANDLE_FLASH_BENCH_DECODE=$shape ncu_to "$log" 100 "${sel[@]}" --launch-skip 20 \
      --launch-count 1 --section WarpStateStats --section SchedulerStats --metrics "$stalls" \
      "$BIN/bench-attention" --decode-only
    if [ "$SASS" = 1 ]; then
      csv=$OUT/ncu-decode-$shape-$name.csv
      : > "$csv"
      CANDLE_FLASH_BENCH_DECODE=$shape ncu_to "$csv" 100 "${sel[@]}" --launch-skip 20 \
        --launch-count 1 --section SourceCounters --page source --print-source sass --csv \
        "$BIN/bench-attention" --decode-only
      echo "### $shape, $name cache: per SASS line ($csv)" >> "$log"
      python3 scripts/profile/sass_hotspots.py "$csv" 20 >> "$log"
    fi
  done
done
wrote "$log"
