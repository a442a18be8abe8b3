#!/usr/bin/env bash
# Runs ON the lent GPU machine: Nsight Compute over one launch of the FP8 forward
# (`flash_fwd_ws_*_d<HD>_fp8`) inside `bench-attention --fp8-only`, for what limits it: the
# stall reasons per issued instruction, each pipe's use (MUFU is the `xu` pipe, wgmma the
# tensor pipe), and the SASS lines where warps stall most.
#
# Usage: bash scripts/profile/fp8.sh [HD] [SKIP] [KERNEL] [TAG]   (default 128 150: the
# SKIP-th launch of that kernel, past the warm-up of the first shapes). KERNEL: ncu's
# --kernel-name (an exact name, or regex:...; default any d HD FP8 kernel of the base tile).
# CANDLE_FLASH_BENCH_CASES=128/16384/n keeps one shape, and KERNEL may be a bf16 kernel (the
# FP8 section times bf16 too). Clocks as the bench runs them.
# Writes $OUT/ncu-fp8TAG.txt (sections and metrics, the SM clock among them) and
# $OUT/ncu-fp8TAG-sass.csv (per SASS line; scripts/profile/sass_hotspots.py summarises it:
# stall reasons, opcodes, hottest lines).
set -uo pipefail
# shellcheck source=scripts/profile/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
hd=${1:-128}
skip=${2:-150}
kernel=${3:-regex:flash_fwd_ws_.*_d${hd}_fp8}
tag=${4:-}
log=$OUT/ncu-fp8$tag.txt
: > "$log"
sel=(--kernel-name "$kernel" --launch-skip "$skip" --launch-count 1)
CANDLE_FLASH_BENCH_HDS=$hd ncu_to "$log" 200 "${sel[@]}" \
  --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats \
  --section WarpStateStats --section InstructionStats \
  --metrics 'regex:^(smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio|sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active|sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active|sm__cycles_elapsed\.avg\.per_second)$' \
  "$BIN/bench-attention" --fp8-only
wrote "$log"
sass=$OUT/ncu-fp8$tag-sass.csv
: > "$sass"
CANDLE_FLASH_BENCH_HDS=$hd ncu_to "$sass" 200 "${sel[@]}" --section SourceCounters \
  --page source --print-source sass --csv "$BIN/bench-attention" --fp8-only
wrote "$sass"
