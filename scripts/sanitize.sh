#!/usr/bin/env bash
# Runs ON the lent GPU machine, from the repo root: compute-sanitizer's four tools over the
# GPU test binary's quick grid, `gpu --quick --sanitize`, which launches every kernel
# (forward, dsum, dK/dV, dQ) for every head-dim class, f16 and bf16, causal or not, with odd
# sizes, plus the reliability checks at reduced sizes (tests/gpu/reliability.rs).
#
# Usage: bash scripts/sanitize.sh [--serial] [--all-kernels] [TOOL...] [-- ARGS for gpu]
#   TOOL           memcheck, racecheck, synccheck, initcheck (default: all four)
#   --serial       one tool after another (default: all at once, one process each)
#   --all-kernels  racecheck and synccheck instrument every kernel; by default only ours
#                  (flash_*): candle's own kernels are not ours to fix and slow racecheck
#                  down. memcheck and initcheck always see every kernel.
# Environment: OUT (default ./out) gets one log per tool, $OUT/sanitize-TOOL.log (4 files at
# most, each cut to 15 MiB); SANITIZE_TIMEOUT, seconds per tool (default 480).
#
# The binary is /tmp/candle-flash-bin/gpu, where scripts/gpu-suite.sh unpacks it; this script
# unpacks .gpu/gpu.xz itself when that is absent or older (carry `.gpu` in the `run` call).
#
# Prints one line per tool, e.g. "memcheck: ERROR SUMMARY: 0 errors", with the binary's own
# summary; where a tool reports errors, the kernels named in them, ours (flash_*) apart from
# others (candle's, cuBLAS'). Exits non-zero if a tool reports an error, produces no summary
# (crash, timeout) or the tests fail under it.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

OUT=${OUT:-./out}
TIMEOUT=${SANITIZE_TIMEOUT:-480}
BIN=/tmp/candle-flash-bin
mkdir -p "$OUT"

SERIAL=0 ALL_KERNELS=0
tools=() gpu_args=(--quick --sanitize)
while [ $# -gt 0 ]; do
  case $1 in
    --serial) SERIAL=1 ;;
    --all-kernels) ALL_KERNELS=1 ;;
    memcheck | racecheck | synccheck | initcheck) tools+=("$1") ;;
    --) shift; gpu_args+=("$@"); break ;;
    *) echo "usage: $0 [--serial] [--all-kernels] [memcheck|racecheck|synccheck|initcheck]... [-- ARGS]" >&2
       exit 2 ;;
  esac
  shift
done
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck synccheck initcheck)

SANITIZER=$(command -v compute-sanitizer)
for candidate in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  if [ -z "$SANITIZER" ] && [ -x "$candidate" ]; then SANITIZER=$candidate; fi
done
if [ -z "$SANITIZER" ]; then
  echo "error: compute-sanitizer not found (PATH, /usr/local/cuda)" >&2
  exit 1
fi

# A staged binary newer than the unpacked one (a fresh .gpu/ on a warm machine) wins.
if [ -f .gpu/gpu.xz ] && { [ ! -x "$BIN/gpu" ] || [ .gpu/gpu.xz -nt "$BIN/gpu" ]; }; then
  mkdir -p "$BIN"
  xz -dc .gpu/gpu.xz > "$BIN/gpu"
  chmod +x "$BIN/gpu"
fi
if [ ! -x "$BIN/gpu" ]; then
  echo "error: neither $BIN/gpu nor .gpu/gpu.xz: run scripts/stage-gpu.sh here and carry .gpu" >&2
  exit 1
fi

# Restricting racecheck and synccheck to our kernels (`--kernel-name kns=flash_`): if this
# compute-sanitizer rejects the option, run_tool notices the instant failure and runs the tool
# again on every kernel.
filter=()
if [ "$ALL_KERNELS" = 0 ]; then filter=(--kernel-name kns=flash_); fi

"$SANITIZER" --version | tail -n 1
echo "binary: $BIN/gpu ${gpu_args[*]}; timeout ${TIMEOUT}s per tool; $([ "$SERIAL" = 1 ] && echo serial || echo parallel)"

run_tool() {  # run_tool TOOL: writes $OUT/sanitize-TOOL.log and $OUT/.TOOL.status
  local tool=$1 extra=() rc=0 start=$SECONDS log=$OUT/sanitize-$1.log
  case $tool in
    racecheck | synccheck) extra=("${filter[@]}") ;;
  esac
  timeout -k 30 "$TIMEOUT" "$SANITIZER" --tool "$tool" --print-limit 1000 "${extra[@]}" \
    "$BIN/gpu" "${gpu_args[@]}" > "$log" 2>&1 || rc=$?
  if [ ${#extra[@]} -gt 0 ] && [ "$rc" != 0 ] && [ $((SECONDS - start)) -lt 10 ] &&
    ! grep -q "SUMMARY:" "$log"; then
    { echo "sanitize.sh: '${extra[*]}' failed at once, running on every kernel; its output was:"
      head -n 5 "$log"; } > "$log.first"
    rc=0
    timeout -k 30 "$TIMEOUT" "$SANITIZER" --tool "$tool" --print-limit 1000 \
      "$BIN/gpu" "${gpu_args[@]}" > "$log" 2>&1 || rc=$?
    cat "$log.first" "$log" > "$log.both" && mv "$log.both" "$log" && rm -f "$log.first"
  fi
  echo "$rc $((SECONDS - start))" > "$OUT/.$tool.status"
}

if [ "$SERIAL" = 1 ]; then
  for tool in "${tools[@]}"; do run_tool "$tool"; done
else
  pids=()
  for tool in "${tools[@]}"; do run_tool "$tool" & pids+=($!); done
  for pid in "${pids[@]}"; do wait "$pid"; done
fi

# One line per tool, from its log; then the kernels named in its reports.
status=0
for tool in "${tools[@]}"; do
  log=$OUT/sanitize-$tool.log
  read -r rc secs < "$OUT/.$tool.status"
  rm -f "$OUT/.$tool.status"
  if ! python3 - "$tool" "$log" "$rc" "$secs" "$TIMEOUT" <<'EOF'; then status=1; fi
import re, sys
from collections import Counter

tool, log, rc, secs, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
text = open(log, errors="replace").read()

errors, summary = None, None
race = re.findall(r"^=+ (RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) errors?, \d+ warnings?\))", text, re.M)
plain = re.findall(r"^=+ (ERROR SUMMARY: (\d+) errors?)\s*$", text, re.M)
if race:
    summary, errors = race[-1][0], int(race[-1][1])
elif plain:
    summary, errors = plain[-1][0], int(plain[-1][1])
tests = re.findall(r"^gpu: \d+ passed, \d+ failed.*$", text, re.M)
tests = tests[-1] if tests else "gpu: no summary line"
if "sanitize.sh: '--kernel-name" in text:
    tests += "; every kernel instrumented (--kernel-name rejected)"

ok = True
if rc in (124, 137):
    line, ok = f"{tool}: TIMEOUT after {limit}s ({summary or 'no summary'}; {tests})", False
elif summary is None:
    line, ok = f"{tool}: no summary in the log (exit status {rc}; {tests})", False
else:
    line = f"{tool}: {summary} ({tests}; exit {rc}; {secs}s)"
    if errors:
        ok = False
    elif rc != 0:
        line += "  <- the binary failed under the tool"
        ok = False
print(line)

# The kernel of each report: a report starts at an unindented "========= X" line, and its
# frames are "at F+0x..", "Device Frame: F+0x..", "at 0x.. in F" (racecheck names both
# accesses in its first line). The top frame may be an inlined device function; the kernel is
# the last frame. Ours are the extern "C" flash_* kernels.
if errors or summary is None:
    ours, others = Counter(), Counter()
    frame = re.compile(r"(?:\bat|Device Frame:) (?:0x[0-9a-f]+ in )?(.+?)(?:\+0x[0-9a-f]+| in \S+:\d+|$)")
    block = []

    def flush():
        if not block:
            return
        flash = [m.group(0) for f in block for m in [re.search(r"flash_\w+(?![\w<])", f)] if m]
        if flash:
            ours[flash[-1]] += 1
        else:
            others[block[-1][:80]] += 1

    for l in text.splitlines():
        if not l.startswith("=") or "Host Frame" in l or "backtrace" in l:
            continue
        if re.match(r"^=+ \S", l):
            flush()
            block = []
        for m in frame.finditer(l):
            name = m.group(1).strip()
            if name and not name.startswith("0x"):
                block.append(name)
    flush()
    fmt = lambda c: ", ".join(f"{k} ({n})" for k, n in c.most_common(12)) or "none"
    print(f"  reports in our kernels (flash_*): {fmt(ours)}")
    print(f"  reports in other kernels: {fmt(others)}")
sys.exit(0 if ok else 1)
EOF
  # The run tool brings back files of up to 16 MiB: keep the head and the tail.
  if [ "$(stat -c %s "$log")" -gt $((15 << 20)) ]; then
    { head -c $((12 << 20)) "$log"; printf '\n[... cut by sanitize.sh ...]\n'; tail -c $((2 << 20)) "$log"; } > "$log.cut"
    mv "$log.cut" "$log"
  fi
done
exit "$status"
