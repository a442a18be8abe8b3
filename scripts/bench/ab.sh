#!/usr/bin/env bash
# Runs ON the lent GPU: an A/B of whole commands, alternated so that both sides see the same
# stretch of the machine's drift. Each COMMAND is a shell string run from the repository root
# (`$BIN` is the staged binaries' folder: scripts/gpu/staged-bin.sh, with the stage before
# this one as `$BIN/prev-NAME` where .gpu/prev/ was carried); `{json}` in it becomes
# a per-run JSON path. Output goes to $OUT/LABEL.log; where JSONs were written, the median per
# record of each label goes to $OUT/LABEL.json and `compare.py --ab` prints one table
# (passes from AB_PASSES, default fwd,bwd).
#
# Usage: OUT=$OUT bash scripts/bench/ab.sh ROUNDS LABEL=COMMAND [LABEL=COMMAND ...]
#   e.g. bash scripts/bench/ab.sh 2 "before=\$BIN/prev-bench-attention --json {json}" \
#          "after=\$BIN/bench-attention --json {json}"
#        bash scripts/bench/ab.sh 2 "n192=\$BIN/bench-attention --fp8-only" \
#          "n128=CANDLE_FLASH_WS_SHAPE=base \$BIN/bench-attention --fp8-only"
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-./out}
mkdir -p "$OUT"
# shellcheck source=scripts/gpu/staged-bin.sh
source scripts/gpu/staged-bin.sh
if [ $# -lt 2 ]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
# Only the binaries the commands name, each once: unpacking costs device time. The stage
# before (scripts/gpu/stage.sh moved it to .gpu/prev/) is $BIN/prev-NAME.
for name in $(printf '%s\n' "${@:2}" | grep -o '\$BIN/[A-Za-z0-9_.-]*' | sort -u); do
  name=${name#\$BIN/}
  case $name in
    prev-*) staged_bin "$name" ".gpu/prev/${name#prev-}.xz" ;;
    *) staged_bin "$name" ;;
  esac
done
export BIN
rounds=$1
shift
W=$(mktemp -d)
for r in $(seq "$rounds"); do
  for spec in "$@"; do
    label=${spec%%=*} cmd=${spec#*=}
    echo "=== round $r: $label" >> "$OUT/$label.log"
    bash -c "${cmd//\{json\}/$W/$label.$r.json}" >> "$OUT/$label.log" 2>&1 ||
      echo "=== $label round $r: exit $?" | tee -a "$OUT/$label.log"
  done
done
ab=()
for spec in "$@"; do
  label=${spec%%=*}
  if compgen -G "$W/$label.*.json" > /dev/null; then
    python3 scripts/bench/median_json.py "$OUT/$label.json" "$W/$label".*.json
    ab+=("$label=$OUT/$label.json")
  fi
done
if [ ${#ab[@]} -gt 1 ]; then
  python3 scripts/bench/compare.py --ab "${ab[@]}" --passes "${AB_PASSES:-fwd,bwd}" | tee "$OUT/ab.md"
fi
