#!/usr/bin/env bash
# Runs ON the lent GPU machine: every kernel of the LLaMA example's decode step at the
# LLaMA-3.2-1B shape (random weights, scripts/model/llama_hf.py), timed one by one by Nsight
# Compute (the one duration metric: one pass, no replay). The step runs uncaptured
# (--no-cuda-graph: the same kernels as its CUDA graph), so the sum of one step's kernel times
# set beside the graph's ms/step (llama-gpu.sh graphs) shows what launches and gaps cost.
#
# Usage: bash scripts/model/llama-profile.sh [BATCH ...]   (default: 1 16)
# Writes $OUT/llama-ncu-bB.csv and $OUT/llama-kernels-bB.txt (scripts/profile/step_table.py).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
# shellcheck source=scripts/gpu/staged-bin.sh
source scripts/gpu/staged-bin.sh
staged_bin example-llama || exit 1
d=/tmp/llama-hf/llama-3.2-1b-random
python3 -c "import sys; sys.path.insert(0, 'scripts/model'); import llama_hf; llama_hf.make_1b('$d')" || exit 1
batches=("$@")
[ ${#batches[@]} -gt 0 ] || batches=(1 16)
steps=6
for b in "${batches[@]}"; do
  csv=$OUT/llama-ncu-b$b.csv
  ncu --metrics gpu__time_duration.sum --csv --print-units base --clock-control none \
    --cache-control none "$BIN/example-llama" --model "$d" --device cuda --dtype bf16 \
    --random-prompt 512 --batch "$b" --max-new-tokens "$steps" --ignore-eos --quiet \
    --no-cuda-graph > "$csv" 2> /tmp/llama-ncu.err
  tail -n 3 /tmp/llama-ncu.err
  python3 scripts/profile/step_table.py "$csv" > "$OUT/llama-kernels-b$b.txt"
  cat "$OUT/llama-kernels-b$b.txt"
done
