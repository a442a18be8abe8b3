#!/usr/bin/env bash
# SASS of our kernels on this machine, which has nvcc and ptxas but no disassembler:
# cuobjdump from Triton's wheel (its NVIDIA backend ships one), downloaded once into
# ~/.cache/candle-flash-sass. Reads the fatbins build.rs wrote for the Hopper set
# (target/release/build/candle-flash-*/out/sm90a/), so build first with
# `CANDLE_FLASH_SASS=90 cargo build --release --features cuda`: the offsets then match those
# that compute-sanitizer and ncu report for a `CANDLE_FLASH_SASS=90` build of the same source.
#
# Usage: bash scripts/gpu/sass.sh FILE KERNEL [OFFSET...]
#   FILE     a fatbin's stem: fwd_ws_sm90, bwd_ws_sm90, fwd_sm90, bwd_sm90, ...
#   KERNEL   an entry point, e.g. flash_bwd_ws_bf16_d256
#   OFFSET   hex offsets (0x1fb0 or 1fb0): print those instructions with 3 before and after
#            instead of the whole function
# Example (racecheck's PCs, docs/archive/PERF.md "racecheck over the backward section"): bash scripts/gpu/sass.sh fwd_ws_sm90 flash_fwd_ws_f16_d128 0xc00 0xc090
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ $# -lt 2 ]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
file=$1 kernel=$2
shift 2

# shellcheck source=scripts/gpu/stage-lib.sh
source scripts/gpu/stage-lib.sh
sass_tools
bin=$SASS_BIN

fatbin=$(ls -t target/release/build/candle-flash-*/out/sm90a/"$file".*.fatbin 2>/dev/null | head -n 1 || true)
if [ -z "$fatbin" ]; then
  echo "error: no target/release/build/candle-flash-*/out/sm90a/$file.*.fatbin: build with CANDLE_FLASH_SASS=90 first" >&2
  exit 1
fi
echo "# $fatbin"
sass=$(PATH="$bin:$PATH" "$bin/cuobjdump" -sass -fun "$kernel" "$fatbin" 2>&1 || true)
if ! grep -q "Function : $kernel\$" <<<"$sass"; then
  echo "error: no function $kernel in $fatbin" >&2
  grep -m 1 fatal <<<"$sass" >&2 || true
  exit 1
fi
if [ $# -eq 0 ]; then
  echo "$sass"
  exit 0
fi
# Instruction lines only (the encoding lines between them dropped), then a window per offset.
lines=$(grep -E '^ +/\*[0-9a-f]{4,}\*/' <<<"$sass")
for off in "$@"; do
  hex=$(printf '%04x' "$((16#${off#0x}))")
  echo "## +0x$hex"
  grep -n -E "/\*0*$hex\*/" <<<"$lines" | head -n 1 | cut -d: -f1 | while read -r n; do
    sed -n "$((n > 3 ? n - 3 : 1)),$((n + 3))p" <<<"$lines" | sed -E 's/ +\/\* 0x[0-9a-f]+ \*\/$//'
  done
done
