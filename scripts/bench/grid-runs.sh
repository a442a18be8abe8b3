#!/usr/bin/env bash
# The same-run grid of docs/archive/bench-h100-s23.md, on the GPU machine: three alternated rounds of
# our bench, PyTorch's SDPA backends and (where staged as .gpu/cfa-bench.xz, built from
# scripts/bench/candle_flash_attn_bench.rs) candle-flash-attn's forward; then per side the median of
# each record over the rounds, scripts/bench/compare.py's tables and plot, and each round's forward
# ratios (the run-to-run spread). Stage with `scripts/gpu/stage.sh --no-examples`, carry
# .gpu, run as `OUT=$OUT bash scripts/bench/grid-runs.sh`.
set -uo pipefail
export OUT=${OUT:-./out}
mkdir -p "$OUT"
source scripts/gpu/staged-bin.sh
for f in .gpu/*.xz; do staged_bin "$(basename "$f" .xz)"; done
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a "$OUT/info.txt"
W=$(mktemp -d)
for r in 1 2 3; do
  "$BIN/bench-attention" --no-decode --no-naive --json "$W/ours$r.json" >> "$OUT/grid.log" 2>&1
  python3 scripts/bench/torch_bench.py --no-decode --json "$W/torch$r.json" >> "$OUT/grid.log" 2>&1
  if [ -x "$BIN/cfa-bench" ]; then "$BIN/cfa-bench" > "$W/cfa$r.json" 2>> "$OUT/cfa.log"; fi
done
python3 scripts/bench/median_json.py "$OUT/ours.json" "$W"/ours[123].json | tee -a "$OUT/info.txt"
python3 scripts/bench/median_json.py "$OUT/torch.json" "$W"/torch[123].json | tee -a "$OUT/info.txt"
more=()
if [ -x "$BIN/cfa-bench" ]; then
  python3 scripts/bench/median_json.py "$OUT/cfa.json" "$W"/cfa[123].json | tee -a "$OUT/info.txt"
  more=("$OUT/cfa.json")
fi
python3 scripts/bench/compare.py "$OUT/ours.json" "$OUT/torch.json" "${more[@]}" --png "$OUT/bench.png" \
  > "$OUT/compare.md" 2>&1
python3 - "$W" >> "$OUT/info.txt" <<'PY'
import json, os, statistics, sys
W = sys.argv[1]
key = lambda x: (x['hd'], x['seqlen'], x['heads'], x['causal'])
for r in (1, 2, 3):
    o = {key(x): x['ms'] for x in json.load(open(f'{W}/ours{r}.json')) if x['pass'] == 'fwd'}
    t = {key(x): x['ms'] for x in json.load(open(f'{W}/torch{r}.json'))
         if x['pass'] == 'fwd' and x['impl'] == 'torch-cudnn'}
    rat = [t[k] / o[k] for k in o if k in t]
    print(f'round {r}: fwd ours/cuDNN min {min(rat):.2f} median {statistics.median(rat):.2f} '
          f'max {max(rat):.2f}; >=1.0 at {sum(x >= 1 for x in rat)} of {len(rat)}')
    if os.path.exists(f'{W}/cfa{r}.json'):
        c = {key(x): x['ms'] for x in json.load(open(f'{W}/cfa{r}.json'))}
        rc = [c[k] / o[k] for k in o if k in c]
        print(f'round {r}: fwd ours/candle-flash-attn min {min(rc):.2f} '
              f'median {statistics.median(rc):.2f} max {max(rc):.2f} over {len(rc)}')
PY
