#!/usr/bin/env bash
# Runs ON the lent GPU machine: the LLaMA example's CUDA-graph decoding step at the
# LLaMA-3.2-1B shape (random weights, scripts/model/llama_hf.py), once per environment
# setting given, so that a launch or tuning switch (CANDLE_FLASH_PDL, CANDLE_FLASH_DECODE_SPLITS,
# ...) is compared in one run on one machine. Prints ms/step and % of the weight-read
# roofline for each.
#
# Usage: bash scripts/model/llama-env-sweep.sh BATCH SETTING ...
#   SETTING: "-" (no change) or one or more words in one argument: VAR=VALUE sets a variable,
#   --flag=value passes an argument to the example (e.g. --kv-cache-dtype=fp8)
#   NEW=tokens (default 256), REPEAT=runs (default 3) and PROMPT=tokens (default 512)
# Example: bash scripts/model/llama-env-sweep.sh 1 - CANDLE_FLASH_PDL=0 \
#   "CANDLE_FLASH_DECODE_SPLITS=8 CANDLE_FLASH_DECODE_WARPS=4"
# (scripts/profile/decode-splits.sh runs its example rows through this.)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
[ $# -ge 2 ] || { echo "usage: $0 BATCH [VAR=VALUE | -] ..." >&2; exit 2; }
# shellcheck source=scripts/gpu/staged-bin.sh
source scripts/gpu/staged-bin.sh
staged_bin example-llama
d=/tmp/llama-hf/llama-3.2-1b-random
[ -f "$d/config.json" ] ||
  python3 -c "import sys; sys.path.insert(0, 'scripts/model'); import llama_hf; llama_hf.make_1b('$d')"
b=$1
shift
printf '| batch | setting | ms/step | %% of roofline |\n|---:|---|---:|---:|\n'
for setting in "$@"; do
  envs=() extra=() words=()
  [ "$setting" = - ] || read -r -a words <<< "$setting"
  for w in "${words[@]}"; do
    case $w in --*) extra+=("$w") ;; *) envs+=("$w") ;; esac
  done
  json=$(env "${envs[@]}" "$BIN/example-llama" --model "$d" --device cuda --dtype bf16 \
    --random-prompt "${PROMPT:-512}" --batch "$b" --max-new-tokens "${NEW:-256}" --ignore-eos \
    --quiet --stats-json --warmup --roofline --repeat "${REPEAT:-3}" "${extra[@]}" \
    2> /tmp/llama-sweep.err | tail -n 1) ||
    { tail -n 5 /tmp/llama-sweep.err >&2; exit 1; }
  python3 - "$b" "$setting" "$json" <<'EOF'
import json, sys
b, setting, s = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
print(f"| {b} | {'default' if setting == '-' else setting} | {s['decode_ms_per_step']:.3f} | {s['roofline_pct']:.0f}% |", flush=True)
EOF
done
