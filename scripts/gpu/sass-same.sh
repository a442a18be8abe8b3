#!/usr/bin/env bash
# Here, no GPU: which kernels of one CUDA file compile to the same machine code in the working
# tree as at a git ref, function by function (cuobjdump's SASS), on the catalogue rows of the
# last `--features cuda` build; and ptxas's spills for the tree's kernels that differ or are
# new. A change meant for a few kernels shows whether it left the measured ones as they were.
# Rows the ref cannot compile (the tree's new variants) are left out of its side.
#
# Usage: bash scripts/gpu/sass-same.sh REF FILE [ARCH]
#   REF   a git ref, e.g. main
#   FILE  a CUDA file under cuda/, e.g. cuda/sm90/fwd_ws.cu
#   ARCH  sm_90a (default; the Hopper set) or sm_80
# Needs nvcc (../shared/cuda/env.sh), a build of the tree (its generated instances/ and
# recorded nvcc commands); cuobjdump comes as sass.sh's does (stage-lib.sh: sass_tools). Two
# whole builds compare with `kernel_digest.py --diff` instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

if [ $# -lt 2 ]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
ref=$1 file=$2 arch=${3:-sm_90a}
virt=compute_${arch#sm_}
# shellcheck source=scripts/gpu/stage-lib.sh
source scripts/gpu/stage-lib.sh
sass_tools
bin=$SASS_BIN
# The stem build.rs gives a file: cuda/sm90/fwd_ws.cu -> sm90_fwd_ws, cuda/train/train.cu -> train.
dir=$(basename "$(dirname "$file")") name=$(basename "$file" .cu)
stem=$([ "$dir" = "$name" ] && echo "$name" || echo "${dir}_$name")
inc=$(ls -t target*/release/build/candle-flash-*/out/instances/"$stem".inc 2>/dev/null | head -n 1 || true)
if [ -z "$inc" ]; then
  echo "error: no instances/$stem.inc under target*/release/build: build with --features cuda first" >&2
  exit 1
fi
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
mkdir -p "$T/inc/instances" "$T/ref"
cp "$inc" "$T/inc/instances/"
git archive "$ref" cuda | tar -x -C "$T/ref"
# The build's own nvcc flags for the file (its recorded command, build/nvcc.rs), less the
# include paths, the one-dtype define, the outputs and the source.
set_dir=$([ "$arch" = sm_80 ] && echo sm80 || echo sm90a)
cmd=$(ls -t "$(dirname "$(dirname "$inc")")/$set_dir/$stem".*.cmd 2>/dev/null | head -n 1 || true)
if [ -z "$cmd" ]; then
  echo "error: no $set_dir/$stem.*.cmd beside $inc: that build has no $arch set" >&2
  exit 1
fi
flags=()
skip=0
for tok in $(cat "$cmd"); do
  if [ "$skip" = 1 ]; then skip=0; continue; fi
  case $tok in
    -o) skip=1 ;;
    -I* | -DCANDLE_FLASH_ONLY_* | -fatbin | -ptx | -gencode=* | -arch=* | *.cu) ;;
    *) flags+=("$tok") ;;
  esac
done
flags+=(-cubin "-gencode=arch=$virt,code=$arch")

# The tree's side from a copy of the rows (the ref's loses those it cannot compile), beside
# the ref's first attempt.
mkdir -p "$T/tree/instances"
cp "$inc" "$T/tree/instances/"
nvcc "${flags[@]}" -Xptxas -v -Icuda -I"$T/tree" "$file" -o "$T/tree.cubin" > "$T/tree.log" 2>&1 &
tree_job=$!
# The ref: drop the instance lines its compile errors point at, until it compiles.
for _ in 1 2 3 4 5 6; do
  if nvcc "${flags[@]}" -I"$T/ref/cuda" -I"$T/inc" "$T/ref/$file" -o "$T/ref.cubin" \
      > "$T/ref.log" 2>&1; then
    break
  fi
  # The instance lines under each error (not under warnings, which also name their lines),
  # and those an error is reported at (a row the ref's templates cannot even name).
  bad=$(awk -v inc="instances/$stem.inc" '
    /: error/ { err = 1 } /: warning/ { err = 0 }
    err && index($0, inc) && match($0, /at line [0-9]+ of/) {
      print substr($0, RSTART + 8, RLENGTH - 11) }
    index($0, inc "(") && match($0, /\.inc\([0-9]+\): error/) {
      print substr($0, RSTART + 5, RLENGTH - 13) }' "$T/ref.log" | sort -un)
  if [ -z "$bad" ]; then
    cat "$T/ref.log" >&2
    exit 1
  fi
  sed -i "$(tr '\n' ' ' <<<"$bad" | sed 's/\([0-9]*\) /\1d;/g')" "$T/inc/instances/$stem.inc"
done
[ -f "$T/ref.cubin" ] || { echo "error: $ref's $file did not compile" >&2; exit 1; }
wait "$tree_job" || { cat "$T/tree.log" >&2; exit 1; }

for side in tree ref; do
  PATH="$bin:$PATH" "$bin/cuobjdump" -sass "$T/$side.cubin" |
    grep -E 'Function :|^ +/\*[0-9a-f]{4,}\*/' | sed -E 's/ +\/\* 0x[0-9a-f]+ \*\/$//' > "$T/$side.sass"
done
python3 - "$T" "$ref" <<'EOF'
import re, sys
t, ref = sys.argv[1], sys.argv[2]
def funcs(path):
    out, cur = {}, None
    for line in open(path):
        if "Function :" in line:
            cur = line.split(":", 1)[1].strip()
            out[cur] = []
        elif cur:
            out[cur].append(line.strip())
    return out
tree, old = funcs(f"{t}/tree.sass"), funcs(f"{t}/ref.sass")
spills = {m[0]: (int(m[1]), int(m[2])) for m in re.findall(
    r"Function properties for (\S+)\n\s+\d+ bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
    open(f"{t}/tree.log").read())}
same = sorted(k for k in tree if k in old and tree[k] == old[k])
differ = sorted(k for k in tree if k in old and tree[k] != old[k])
new = sorted(k for k in tree if k not in old)
print(f"{len(same)} identical to {ref}, {len(differ)} differ, {len(new)} only in the tree")
for label, names in (("differ", differ), ("new", new)):
    for k in names:
        st, ld = spills.get(k, (0, 0))
        print(f"  {label}: {k} ({len(old.get(k, []))} -> {len(tree[k])} instructions; spill stores {st}, loads {ld})")
EOF
