#!/usr/bin/env bash
# Runs ON the lent GPU machine, from the repo root, with the binaries that
# scripts/gpu/stage.sh put in .gpu/ (carry `.gpu` in the `run` call).
#
# Usage: bash scripts/gpu/suite.sh [--bench] [--torch] [--sanitize] [ARGS for the gpu binary]
#   --bench     also run the staged bench binary      -> $OUT/bench.log, $OUT/bench.json
#   --torch     also run scripts/bench/torch_bench.py        -> $OUT/bench.log (appended), $OUT/torch.json
#               and scripts/bench/compare.py on both JSONs   -> $OUT/compare.md, $OUT/bench.png
#   --sanitize  compute-sanitizer memcheck on `gpu --quick` -> $OUT/sanitizer.log
# At most 7 files land in $OUT (the run tool brings back 8). Exits with the gpu tests' status.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

OUT=${OUT:-./out}
# shellcheck source=scripts/gpu/staged-bin.sh
source scripts/gpu/staged-bin.sh
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"

BENCH=0 TORCH=0 SANITIZE=0
args=()
for arg in "$@"; do
  case $arg in
    --bench) BENCH=1 ;;
    --torch) TORCH=1 ;;
    --sanitize) SANITIZE=1 ;;
    *) args+=("$arg") ;;
  esac
done

if [ ! -f .gpu/gpu.xz ]; then
  echo "error: .gpu/gpu.xz missing: run scripts/gpu/stage.sh here and carry .gpu" >&2
  exit 1
fi
for f in .gpu/*.xz; do
  staged_bin "$(basename "$f" .xz)"
done

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# Run each step even if an earlier one failed (device time is scarce); record statuses.
summary=()
run_step() {  # run_step NAME LOGFILE [--append] CMD...
  local name=$1 log=$2 tee_args=() rc=0
  shift 2
  if [ "${1:-}" = --append ]; then tee_args=(-a); shift; fi
  echo "=== $name: $*"
  "$@" 2>&1 | tee "${tee_args[@]}" "$log" || rc=$?
  summary+=("$name rc=$rc")
  return "$rc"
}

gpu_rc=0
run_step tests "$OUT/gpu-tests.log" "$BIN/gpu" "${args[@]}" || gpu_rc=$?
# The softcap alone runs the backward's `_cap` kernels at head dims up to 128; the mods
# section once more on the `_mods` kernels' capped path (without arguments only: a run given
# its own sections or --quick keeps to them).
if [ ${#args[@]} = 0 ]; then
  rc=0
  run_step tests-mods-nocap "$OUT/gpu-tests.log" --append \
    env CANDLE_FLASH_BWD_CAP=0 "$BIN/gpu" --only mods || rc=$?
  [ "$rc" = 0 ] || [ "$gpu_rc" != 0 ] || gpu_rc=$rc
  # Decoding calls with their K/V appends as launches of their own (fused into the decode
  # launch by default where a K/V head's query rows fit one tile).
  rc=0
  run_step tests-kvcache-unfused "$OUT/gpu-tests.log" --append \
    env CANDLE_FLASH_FUSED_APPEND=0 "$BIN/gpu" --only kvcache,fp8 || rc=$?
  [ "$rc" = 0 ] || [ "$gpu_rc" != 0 ] || gpu_rc=$rc
  # Split decode launches merging through global memory (on Hopper they merge inside
  # thread-block clusters where those fit).
  rc=0
  run_step tests-kvcache-global-merge "$OUT/gpu-tests.log" --append \
    env CANDLE_FLASH_DECODE_CLUSTER=0 "$BIN/gpu" --only kvcache,fp8 || rc=$?
  [ "$rc" = 0 ] || [ "$gpu_rc" != 0 ] || gpu_rc=$rc
  # The Ampere/Ada path's attention as an A100 (163 KB of shared memory a block) and an RTX
  # 4090 (99 KB) take it: tiles that only those limits choose, e.g. the d 256 backward's
  # single-buffered `_grid_q1` and the 99 KB devices' small tiles.
  for kb in 163 99; do
    rc=0
    run_step "tests-sm80-${kb}k" "$OUT/gpu-tests.log" --append \
      env CANDLE_FLASH_ARCH=sm80 CANDLE_FLASH_SMEM_KB=$kb "$BIN/gpu" --only fwd,bwd || rc=$?
    [ "$rc" = 0 ] || [ "$gpu_rc" != 0 ] || gpu_rc=$rc
  done
  # Every catalogue kernel of the device's set loads with the launch bounds of its geometry.
  if [ -x "$BIN/unit" ]; then
    rc=0
    run_step catalogue "$OUT/gpu-tests.log" --append \
      "$BIN/unit" --ignored --nocapture every_kernel_loads_with_its_geometry || rc=$?
    [ "$rc" = 0 ] || [ "$gpu_rc" != 0 ] || gpu_rc=$rc
  fi
fi

if [ "$BENCH" = 1 ]; then
  if [ -x "$BIN/bench-attention" ]; then
    run_step bench "$OUT/bench.log" "$BIN/bench-attention" --json "$OUT/bench.json" || true
  else
    echo "=== bench: not staged (.gpu/bench-attention.xz missing)"
  fi
fi

if [ "$TORCH" = 1 ]; then
  run_step torch "$OUT/bench.log" --append \
    python3 scripts/bench/torch_bench.py --json "$OUT/torch.json" || true
  if [ -f "$OUT/bench.json" ] && [ -f "$OUT/torch.json" ]; then
    run_step compare "$OUT/compare.md" \
      python3 scripts/bench/compare.py "$OUT/bench.json" "$OUT/torch.json" --png "$OUT/bench.png" || true
  fi
fi

if [ "$SANITIZE" = 1 ]; then
  # Last: it is slow, and the results above are already written if it runs out of time.
  # Its output can be huge, so it goes to the file; only the tail is shown.
  rc=0
  echo "=== sanitize: compute-sanitizer --tool memcheck gpu --quick"
  compute-sanitizer --tool memcheck --error-exitcode 99 "$BIN/gpu" --quick \
    > "$OUT/sanitizer.log" 2>&1 || rc=$?
  tail -n 20 "$OUT/sanitizer.log"
  summary+=("sanitize rc=$rc")
  # memcheck's status counts: errors (99) or a crash fail the run even if the tests passed.
  [ "$rc" = 0 ] || [ "$gpu_rc" != 0 ] || gpu_rc=$rc
fi

echo "=== steps: ${summary[*]}"
# The gpu binary's own summary lines: "gpu: N passed, N failed[, N skipped]" (the full run's,
# then the second mods run's).
grep -E '^gpu: [0-9]+ passed' "$OUT/gpu-tests.log" ||
  echo "gpu: no summary line (crashed? exit status $gpu_rc)"
exit "$gpu_rc"
