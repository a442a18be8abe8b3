#!/usr/bin/env bash
# Runs ON the lent GPU machine: where one training step's time goes, for the fine-tuning
# example (nsys kernel summary over the timed steps) and for PyTorch on the same shape
# (torch.profiler). Staged binaries from scripts/gpu/stage.sh (carry .gpu).
# Usage: bash scripts/model/finetune-profile.sh [CONFIG] [CONTEXT] [BATCH]   (default 150m 2048 8)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
# shellcheck source=scripts/gpu/staged-bin.sh
source scripts/gpu/staged-bin.sh
staged_bin example-finetune || exit 1
cfg=${1:-150m} ctx=${2:-2048} b=${3:-8}
NSYS=$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -n1)
args=(--config "$cfg" --task random --context "$ctx" --batch "$b" --warmup 2
  --eval-every 1000 --eval-batches 1 --no-progress --no-save --stats-json --out /tmp/ft-prof)
if [ -n "$NSYS" ]; then
  "$NSYS" profile -o /tmp/ft-prof-rep --force-overwrite true -t cuda,nvtx "$BIN/example-finetune" "${args[@]}" --steps 6 | tail -n 1
  "$NSYS" stats -r cuda_gpu_kern_sum,cuda_gpu_mem_time_sum,cuda_api_sum -f csv -o /tmp/ft-prof /tmp/ft-prof-rep.nsys-rep > /dev/null
  for f in /tmp/ft-prof_*.csv; do cp "$f" "$OUT/"; done
else
  # No nsys there: ncu with the one duration metric (one pass, no replay), every kernel of a
  # 2-step run (step 1 pays cuBLAS/JIT set-up; scripts/profile/kernel_table.py splits by step).
  ncu --metrics gpu__time_duration.sum --csv --print-units base --clock-control none \
    "$BIN/example-finetune" "${args[@]}" --steps 2 > /tmp/ft-ncu.csv 2> /tmp/ft-ncu.err
  tail -n 3 /tmp/ft-ncu.err
  python3 scripts/profile/kernel_table.py /tmp/ft-ncu.csv > "$OUT/ft-kernels.txt"
  head -n 60 "$OUT/ft-kernels.txt"
fi
python3 scripts/model/finetune_torch.py --config "$cfg" --seq-len "$ctx" --batch "$b" --steps 6 --profile "$OUT/torch-profile.txt"
