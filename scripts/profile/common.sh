# Sourced by the Nsight Compute scripts of scripts/profile/ (attn.sh, decode.sh, vs-fa2.sh),
# which run ON the lent GPU machine: goes to the repository root, makes $OUT (default ./out),
# unpacks the staged bench binary (scripts/gpu/stage.sh put it in .gpu/; carry .gpu) as
# $BIN/bench-attention, and defines the ncu call and closing line they share.
# shellcheck shell=bash

cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1
OUT=${OUT:-./out}
mkdir -p "$OUT"
# shellcheck source=scripts/gpu/staged-bin.sh
source scripts/gpu/staged-bin.sh
staged_bin bench-attention || exit 1

# ncu_to LOG LIMIT ARGS...: `ncu --clock-control none ARGS...` under `timeout LIMIT`, its
# output appended to LOG without ncu's "==PROF==" progress lines. Variables set on the call
# (`CANDLE_FLASH_BENCH_CASES=$c ncu_to ...`) reach ncu and the program it profiles.
ncu_to() {
  local log=$1 limit=$2
  shift 2
  timeout "$limit" ncu --clock-control none "$@" 2>&1 | grep -v "^==PROF==" >> "$log"
}

# wrote LOG: the closing line, LOG's name and length.
wrote() {
  echo "wrote $1 ($(wc -l < "$1") lines)"
}
