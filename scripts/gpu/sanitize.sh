#!/usr/bin/env bash
# Runs ON the lent GPU machine, from the repo root: compute-sanitizer's four tools over the
# GPU test binary's quick grid, `gpu --quick --sanitize --only SECTION`, which launches every
# kernel (forward, dsum, dK/dV, dQ for every head-dim class; varlen, dropout, append, decode,
# paged decode, combine), f16 and bf16, causal or not, with odd sizes, plus the reliability
# checks at reduced sizes. Under --sanitize the binary draws inputs and computes references on
# the CPU, so that the device runs only our kernels, copies and Candle's element-wise kernels
# (no cuBLAS, whose writes initcheck does not see, no curand).
#
# Usage: bash scripts/gpu/sanitize.sh [-j N | --serial] [--all-kernels] [--sections LIST]
#                                 [TOOL...] [-- ARGS for gpu]
#   TOOL             memcheck, racecheck, synccheck, initcheck (default: all four)
#   --sections LIST  comma-separated, from fwd,bwd,mods,varlen,kvcache,misc,reliability,train (default:
#                    all eight)
#   -j N             sanitized processes at once (default 2); --serial is -j 1
#   --all-kernels    racecheck and synccheck instrument every kernel; by default only ours
#                    (flash_*): Candle's own kernels are not ours to fix and slow racecheck
#                    down. memcheck and initcheck always see every kernel.
# Environment: OUT (default ./out) gets one log per tool, $OUT/sanitize-TOOL.log, its sections
# one after another (4 files at most, each under 15 MiB: the run tool brings back 8 files of up
# to 16 MiB); SANITIZE_TIMEOUT, seconds per (tool, section) (default 240); SANITIZE_BUDGET,
# seconds for the whole script (default 540, under the run tool's 600 s per command): a (tool,
# section) that cannot start in time is reported as not run, and each one's limit is cut to
# the time left, so the summary is always written.
#
# One process per (tool, section): racecheck over the whole binary ended in "Internal
# Sanitizer Error (failed to handle a hardware exception)" at the first KV-cache case even
# with one kernel of ours instrumented, while the KV-cache section alone, every kernel
# instrumented, was clean. Short processes keep the sanitizer's accumulated state small, and
# a crash or a timeout costs one section instead of every section after it.
#
# The binary is /tmp/candle-flash-bin/gpu, where scripts/gpu/suite.sh unpacks it; this script
# unpacks .gpu/gpu.xz itself when that is absent or older (carry `.gpu` in the `run` call).
#
# Prints one line per tool, e.g. "memcheck: ERROR SUMMARY: 0 errors (...)", its errors summed
# over the sections, then one line per section with that section's summary, its
# `gpu: N passed, N failed` line, exit status and time; where a tool reports errors, the
# kernels named in them, ours (flash_*) apart from others (Candle's, cuBLAS'). Exits 1 if a
# section reports an error, produces no summary (crash, timeout, not run) or its tests fail
# under the tool; 2 on bad usage.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.." || exit 1

OUT=${OUT:-./out}
TIMEOUT=${SANITIZE_TIMEOUT:-240}
BUDGET=${SANITIZE_BUDGET:-540}
# shellcheck source=scripts/gpu/staged-bin.sh
source scripts/gpu/staged-bin.sh
ALL_SECTIONS=(fwd bwd mods sinks sparse varlen kvcache misc reliability train)
T0=$(date +%s)

usage() {
  echo "usage: $0 [-j N | --serial] [--all-kernels] [--sections fwd,bwd,varlen,kvcache,misc,reliability,train]" \
    "[memcheck|racecheck|synccheck|initcheck]... [-- ARGS for gpu]" >&2
  exit 2
}

# Two processes at once by default, not one per tool as before: under --sanitize each
# process also does its reference math on the host's cores, and racecheck and initcheck do
# heavy host-side work, so more processes mostly slow each other down (and make the
# per-section limits unpredictable) while two still halve the wall time of a serial run.
JOBS=2 ALL_KERNELS=0
tools=() sections=() gpu_args=(--quick --sanitize)
while [ $# -gt 0 ]; do
  case $1 in
    --serial) JOBS=1 ;;
    -j | --jobs) [ $# -ge 2 ] || usage; JOBS=$2; shift ;;
    -j[0-9]*) JOBS=${1#-j} ;;
    --all-kernels) ALL_KERNELS=1 ;;
    --sections) [ $# -ge 2 ] || usage; IFS=, read -r -a sections <<< "$2"; shift ;;
    memcheck | racecheck | synccheck | initcheck) tools+=("$1") ;;
    --) shift; gpu_args+=("$@"); break ;;
    *) usage ;;
  esac
  shift
done
[[ $JOBS =~ ^[1-9][0-9]*$ ]] || usage
[ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck synccheck initcheck)
[ ${#sections[@]} -gt 0 ] || sections=("${ALL_SECTIONS[@]}")
for section in "${sections[@]}"; do
  [[ " ${ALL_SECTIONS[*]} " == *" $section "* ]] || { echo "unknown section: $section" >&2; usage; }
done

SANITIZER=$(command -v compute-sanitizer)
for candidate in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  if [ -z "$SANITIZER" ] && [ -x "$candidate" ]; then SANITIZER=$candidate; fi
done
if [ -z "$SANITIZER" ]; then
  echo "error: compute-sanitizer not found (PATH, /usr/local/cuda)" >&2
  exit 1
fi

staged_bin gpu || exit 1

mkdir -p "$OUT"
# Per-(tool, section) logs live outside $OUT: everything left there comes back, and only the
# assembled per-tool logs should.
PARTS=$(mktemp -d /tmp/sanitize-parts.XXXXXX)
trap 'rm -rf "$PARTS"' EXIT

# The references' CPU math (gemm, rayon) would otherwise start one thread per core in each
# of the JOBS processes.
if [ -z "${RAYON_NUM_THREADS:-}" ]; then
  RAYON_NUM_THREADS=$(( $(nproc) / JOBS ))
  [ "$RAYON_NUM_THREADS" -ge 1 ] || RAYON_NUM_THREADS=1
  export RAYON_NUM_THREADS
fi

# Restricting racecheck and synccheck to our kernels (`--kernel-name kns=flash_`): if this
# compute-sanitizer rejects the option, run_one notices the instant failure and runs the tool
# again on every kernel.
filter=()
if [ "$ALL_KERNELS" = 0 ]; then filter=(--kernel-name kns=flash_); fi

"$SANITIZER" --version | tail -n 1
echo "binary: $BIN/gpu ${gpu_args[*]} --only SECTION; sections: ${sections[*]};" \
  "${TIMEOUT}s per (tool, section), ${BUDGET}s in all; $JOBS at once;" \
  "racecheck/synccheck on $([ "$ALL_KERNELS" = 1 ] && echo 'every kernel' || echo 'flash_* kernels')"

run_one() {  # run_one TOOL SECTION LIMIT: writes $PARTS/TOOL.SECTION.{log,status}
  local tool=$1 section=$2 limit=$3 extra=() rc=0 start
  local log=$PARTS/$tool.$section.log
  start=$(date +%s)
  case $tool in
    racecheck | synccheck) extra=("${filter[@]}") ;;
  esac
  timeout -k 30 "$limit" "$SANITIZER" --tool "$tool" --print-limit 1000 "${extra[@]}" \
    "$BIN/gpu" "${gpu_args[@]}" --only "$section" > "$log" 2>&1 || rc=$?
  if [ ${#extra[@]} -gt 0 ] && [ "$rc" != 0 ] && [ $(($(date +%s) - start)) -lt 10 ] &&
    ! grep -q "SUMMARY:" "$log"; then
    { echo "sanitize.sh: '${extra[*]}' failed at once, running on every kernel; its output was:"
      head -n 5 "$log"; } > "$log.first"
    rc=0
    timeout -k 30 "$limit" "$SANITIZER" --tool "$tool" --print-limit 1000 \
      "$BIN/gpu" "${gpu_args[@]}" --only "$section" > "$log" 2>&1 || rc=$?
    cat "$log.first" "$log" > "$log.both" && mv "$log.both" "$log" && rm -f "$log.first"
  fi
  echo "$rc $(($(date +%s) - start)) $limit" > "$PARTS/$tool.$section.status"
}

# Slowest tools first, so that the last jobs to run are short ones.
order=()
for tool in racecheck initcheck memcheck synccheck; do
  [[ " ${tools[*]} " == *" $tool "* ]] && order+=("$tool")
done
running=0
for tool in "${order[@]}"; do
  for section in "${sections[@]}"; do
    if [ "$running" -ge "$JOBS" ]; then
      wait -n
      running=$((running - 1))
    fi
    left=$((BUDGET - ($(date +%s) - T0)))
    if [ "$left" -lt 20 ]; then
      echo "skipped" > "$PARTS/$tool.$section.status"
      continue
    fi
    run_one "$tool" "$section" "$((left < TIMEOUT ? left : TIMEOUT))" &
    running=$((running + 1))
  done
done
wait

python3 - "$OUT" "$PARTS" "${tools[*]}" "${sections[*]}" <<'EOF'
import os, re, sys
from collections import Counter

out, parts, tools, sections = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split()
# Each tool's log holds every section: share 15 MiB between them, keeping each section's
# head (the first reports) and tail (its summaries).
part_cap = (15 << 20) // len(sections)


def cut(data):
    if len(data) <= part_cap:
        return data
    head, tail = part_cap * 3 // 4, part_cap // 4 - 64
    return data[:head] + b"\n[... cut by sanitize.sh ...]\n" + data[-tail:]


# The kernel of each report: a report starts at an unindented "========= X" line, and its
# frames are "at F+0x..", "Device Frame: F+0x..", "at 0x.. in F" (racecheck names both
# accesses in its first line). The top frame may be an inlined device function; the kernel is
# the last frame. Ours are the extern "C" flash_* kernels.
frame = re.compile(r"(?:\bat|Device Frame:) (?:0x[0-9a-f]+ in )?(.+?)(?:\+0x[0-9a-f]+| in \S+:\d+|$)")


def attribute(text, ours, others):
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
            block.clear()
        for m in frame.finditer(l):
            name = m.group(1).strip()
            if name and not name.startswith("0x"):
                block.append(name)
    flush()


status = 0
for tool in tools:
    ok, lines, chunks = True, [], []
    errors = hazards = warnings = passed = failed = seconds = 0
    race = False
    ours, others = Counter(), Counter()
    for section in sections:
        base = os.path.join(parts, f"{tool}.{section}")
        try:
            st = open(base + ".status").read().split()
        except FileNotFoundError:
            st = ["skipped"]
        if st[0] == "skipped":
            ok = False
            lines.append(f"  {section:<12} not run: SANITIZE_BUDGET ran out")
            chunks.append(f"##### sanitize.sh: {tool} --only {section}: not run (budget)\n".encode())
            continue
        rc, secs, limit = int(st[0]), int(st[1]), int(st[2])
        seconds += secs
        data = open(base + ".log", "rb").read()
        text = data.decode(errors="replace")
        chunks.append(f"##### sanitize.sh: {tool} --only {section}: exit {rc}, {secs}s\n".encode() + cut(data))

        summary, errs = None, None
        r = re.findall(r"^=+ (RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\))", text, re.M)
        p = re.findall(r"^=+ (ERROR SUMMARY: (\d+) errors?)\s*$", text, re.M)
        if r:
            summary, errs = r[-1][0], int(r[-1][2])
            hazards, warnings, race = hazards + int(r[-1][1]), warnings + int(r[-1][3]), True
        elif p:
            summary, errs = p[-1][0], int(p[-1][1])
        tests = re.findall(r"^gpu: (\d+) passed, (\d+) failed.*$", text, re.M)
        if tests:
            passed, failed = passed + int(tests[-1][0]), failed + int(tests[-1][1])
            tests_line = f"gpu: {tests[-1][0]} passed, {tests[-1][1]} failed"
        else:
            tests_line = "gpu: no summary line"
        notes = []
        if "Internal Sanitizer Error" in text:
            notes.append("Internal Sanitizer Error")
        if "sanitize.sh: '--kernel-name" in text:
            notes.append("every kernel instrumented (--kernel-name rejected)")

        if errs:
            errors += errs
        if rc in (124, 137):
            line = f"TIMEOUT after {limit}s ({summary or 'no summary'}; {tests_line})"
            ok = False
        elif summary is None:
            line = f"no summary in the log (exit status {rc}; {tests_line})"
            ok = False
        else:
            line = f"{summary}; {tests_line}; exit {rc}; {secs}s"
            if errs:
                ok = False
            elif rc != 0:
                line += "  <- the binary failed under the tool"
                ok = False
        if notes:
            line += " [" + "; ".join(notes) + "]"
        lines.append(f"  {section:<12} {line}")
        if errs or summary is None:
            attribute(text, ours, others)

    if passed + failed == 0:
        # "0 errors" over no test at all is not a pass.
        ok = False
        lines.append("  no test ran under this tool")
    with open(os.path.join(out, f"sanitize-{tool}.log"), "wb") as f:
        f.write(b"".join(chunks))
    n = lambda k, word: f"{k} {word}{'' if k == 1 else 's'}"
    total = (f"RACECHECK SUMMARY: {n(hazards, 'hazard')} displayed ({n(errors, 'error')},"
             f" {n(warnings, 'warning')})" if race else f"ERROR SUMMARY: {n(errors, 'error')}")
    print(f"{tool}: {total} over {len(sections)} sections (gpu: {passed} passed, {failed} failed;"
          f" {seconds}s of runs){'' if ok else '  <- FAILED'}")
    print("\n".join(lines))
    if ours or others:
        fmt = lambda c: ", ".join(f"{k} ({n})" for k, n in c.most_common(12)) or "none"
        print(f"  reports in our kernels (flash_*): {fmt(ours)}")
        print(f"  reports in other kernels: {fmt(others)}")
    if not ok:
        status = 1
sys.exit(status)
EOF
status=$?
echo "sanitize.sh: $(($(date +%s) - T0))s in all"
exit "$status"
