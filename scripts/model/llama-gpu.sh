#!/usr/bin/env bash
# Runs ON the lent GPU machine, from the repo root, with the staged llama example
# (scripts/gpu/stage.sh; carry .gpu): its parity with Hugging Face transformers and/or its
# speed table against candle-transformers and transformers (scripts/model/llama_hf.py).
#
# Usage: bash scripts/model/llama-gpu.sh [parity] [bench] [-- ARGS for llama_hf.py bench]
# Writes $OUT/llama-parity.log, $OUT/llama-bench.log, $OUT/llama-bench.md/.json.
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
    parity | bench) what+=("$1") ;;
    --) shift; extra=("$@"); break ;;
    *) echo "usage: $0 [parity] [bench] [-- ARGS]" >&2; exit 2 ;;
  esac
  shift
done
[ ${#what[@]} -gt 0 ] || what=(parity bench)

rc=0
for w in "${what[@]}"; do
  if [ "$w" = parity ]; then
    python3 scripts/model/llama_hf.py parity "$BIN/example-llama" --out /tmp/llama-hf 2>&1 |
      tee "$OUT/llama-parity.log" || rc=1
  else
    python3 scripts/model/llama_hf.py bench "$BIN/example-llama" --out /tmp/llama-hf "${extra[@]}" 2>&1 |
      tee "$OUT/llama-bench.log" || rc=1
    cp /tmp/llama-hf/llama-bench.md /tmp/llama-hf/llama-bench.json "$OUT/" 2>/dev/null || true
  fi
done
exit "$rc"
