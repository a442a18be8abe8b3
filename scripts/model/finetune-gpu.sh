#!/usr/bin/env bash
# Runs ON the lent GPU machine, from the repo root, with the staged fine-tuning example
# (scripts/gpu/stage.sh; carry .gpu): the built-in copy task at context 2048 (the default run),
# then training tokens/s and peak memory for flash, naive and PyTorch (scripts/model/finetune_torch.py)
# at 16k tokens per step.
# Usage: bash scripts/model/finetune-gpu.sh [learn] [speed] [packed-ab] [patched-ab] [no-naive] [CONFIGS...]
#   (configs: 150m 1b; packed-ab: flash also with CANDLE_FLASH_WS_PACKED=0, the older kernels
#   for packed batches, its JSON line prefixed "packed_ws=0 "; patched-ab: flash also with
#   .gpu/example-finetune-patched.xz, the example built against the patched candle-core of
#   scripts/bench/candle-patched.sh, its JSON line prefixed "candle_patched "; no-naive: skip
#   naive attention)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# shellcheck source=scripts/gpu/staged-bin.sh
source scripts/gpu/staged-bin.sh
staged_bin example-finetune || exit 1
FT=$BIN/example-finetune
what=() configs=() attns=(flash naive)
for a in "$@"; do
  case $a in
    learn | speed) what+=("$a") ;;
    packed-ab) attns=("${attns[@]/flash/flash flash-old}") ;;
    patched-ab) attns=("${attns[@]/flash/flash flash-patched}") ;;
    no-naive) attns=("${attns[@]/naive/}") ;;
    *) configs+=("$a") ;;
  esac
done
read -r -a attns <<< "${attns[*]}"
[ ${#what[@]} -gt 0 ] || what=(learn speed)
[ ${#configs[@]} -gt 0 ] || configs=(150m)
for w in "${what[@]}"; do
  if [ "$w" = learn ]; then
    "$FT" --context 2048 --no-progress --stats-json --out /tmp/ft-copy 2>&1 | tee "$OUT/finetune-learn.log"
    cp /tmp/ft-copy/loss.svg "$OUT/finetune-loss.svg" 2>/dev/null || true
  else
    for cfg in "${configs[@]}"; do
      for cb in 512:32 2048:8 8192:2; do
        ctx=${cb%:*} b=${cb#*:}
        for attn in "${attns[@]}"; do
          packed=1 prefix= ft=$FT
          if [ "$attn" = flash-old ]; then attn=flash packed=0 prefix="packed_ws=0 "; fi
          if [ "$attn" = flash-patched ]; then
            staged_bin example-finetune-patched || continue
            attn=flash prefix="candle_patched " ft=$BIN/example-finetune-patched
          fi
          CANDLE_FLASH_WS_PACKED=$packed "$ft" --config "$cfg" --task random --context "$ctx" \
            --batch "$b" --steps 8 --warmup 2 --eval-every 1000 --eval-batches 1 \
            --attention "$attn" --no-progress --no-save --stats-json --out /tmp/ft-speed \
            2> /tmp/ft-err.log | tail -n 1 | sed "s/^/$prefix/" ||
            echo "{\"attention\": \"$attn\", \"config\": \"$cfg\", \"context\": $ctx, \"error\": \"$(grep -m1 -E '^Error' /tmp/ft-err.log | cut -c1-150 | tr -d '"')\"}"
        done
        python3 scripts/model/finetune_torch.py --config "$cfg" --seq-len "$ctx" --batch "$b" --steps 8
      done
    done 2>&1 | tee -a "$OUT/finetune-speed.log"
  fi
done
