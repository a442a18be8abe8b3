#!/usr/bin/env bash
# Runs ON the lent GPU machine, from the repo root, with the staged llama example
# (scripts/gpu/stage.sh; carry .gpu): its parity with Hugging Face transformers and/or its
# speed table against candle-transformers and transformers (scripts/model/llama_hf.py), and/or
# the decoding step with and without CUDA graphs (graphs: batch 1 and 16, ms/step, % of the
# weight-read roofline, and a failure unless the greedy tokens of the two are identical).
#
# Usage: bash scripts/model/llama-gpu.sh [parity] [bench] [graphs] [-- ARGS for llama_hf.py]
# (no mode: parity and bench). Writes $OUT/llama-parity.log, $OUT/llama-bench.log,
# $OUT/llama-bench.md/.json, $OUT/llama-graphs.log, $OUT/llama-graphs.md/.json.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# shellcheck source=scripts/gpu/staged-bin.sh
source scripts/gpu/staged-bin.sh
staged_bin example-llama

what=() extra=()
while [ $# -gt 0 ]; do
  case $1 in
    parity | bench | graphs) what+=("$1") ;;
    --) shift; extra=("$@"); break ;;
    *) echo "usage: $0 [parity] [bench] [graphs] [-- ARGS]" >&2; exit 2 ;;
  esac
  shift
done
[ ${#what[@]} -gt 0 ] || what=(parity bench)

rc=0
for w in "${what[@]}"; do
  if [ "$w" = parity ]; then
    python3 scripts/model/llama_hf.py parity "$BIN/example-llama" --out /tmp/llama-hf 2>&1 |
      tee "$OUT/llama-parity.log" || rc=1
  elif [ "$w" = graphs ]; then
    python3 scripts/model/llama_hf.py graphs "$BIN/example-llama" --out /tmp/llama-hf "${extra[@]}" 2>&1 |
      tee "$OUT/llama-graphs.log" || rc=1
    cp /tmp/llama-hf/llama-graphs.md /tmp/llama-hf/llama-graphs.json "$OUT/" 2>/dev/null || true
  else
    python3 scripts/model/llama_hf.py bench "$BIN/example-llama" --out /tmp/llama-hf "${extra[@]}" 2>&1 |
      tee "$OUT/llama-bench.log" || rc=1
    cp /tmp/llama-hf/llama-bench.md /tmp/llama-hf/llama-bench.json "$OUT/" 2>/dev/null || true
  fi
done
exit "$rc"
