#!/usr/bin/env bash
# Runs ON the lent GPU machine: a few Nsight Compute counters over every launch of one kernel
# (from the SKIP-th on) inside `bench-attention ARGS`, then the launches grouped by duration
# (scripts/profile/launch_groups.py): per group its first launch index, count and mean
# counters. The bench's adaptive iteration counts make the launch index of a shape unknown in
# advance; this finds it, for a `--launch-skip` of a heavier section (SourceCounters: fp8.sh,
# attn.sh) on one launch of the shape wanted.
#
# Usage: bash scripts/profile/launches.sh REGEX SKIP COUNT [bench-attention ARGS...]
#   e.g. CANDLE_FLASH_BENCH_HDS=128 bash scripts/profile/launches.sh \
#          'flash_fwd_ws_.*_d128_fp8' 1500 2500 --fp8-only
# Variables set on the call reach ncu and the bench (CANDLE_FLASH_WS_SHAPE=..., ...).
# Writes $OUT/launches.csv (ncu's raw page) and prints the groups.
set -uo pipefail
# shellcheck source=scripts/profile/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
if [ $# -lt 3 ]; then
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
re=$1 skip=$2 count=$3
shift 3
metrics=gpu__time_duration.sum,smsp__inst_executed.sum
metrics+=,sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active
metrics+=,smsp__issue_active.avg.pct_of_peak_sustained_active
for s in long_scoreboard wait barrier mio_throttle math_pipe_throttle dispatch_stall; do
  metrics+=,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio
done
csv=$OUT/launches.csv
: > "$csv"
ncu_to "$csv" 300 --kernel-name "regex:$re" --launch-skip "$skip" --launch-count "$count" \
  --metrics "$metrics" --csv --page raw "$BIN/bench-attention" "$@"
wrote "$csv"
python3 scripts/profile/launch_groups.py "$csv" "$skip" "$metrics"
