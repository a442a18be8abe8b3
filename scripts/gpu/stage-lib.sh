# Sourced by the scripts that stage binaries here for the lent GPU (scripts/gpu/stage.sh,
# scripts/bench/candle-patched.sh --stage).
# shellcheck shell=bash

# cuda_toolchain: sources ../shared/cuda/env.sh (nvcc and the CUDA libraries on PATH); fails
# with the installer's name where it or nvcc is missing.
cuda_toolchain() {
  local env_sh=../shared/cuda/env.sh
  if [ ! -f "$env_sh" ]; then
    echo "error: $env_sh not found; run: bash ../shared/cuda/setup-toolchain.sh" >&2
    return 1
  fi
  # shellcheck source=/dev/null
  source "$env_sh"
  if ! command -v nvcc >/dev/null; then
    echo "error: nvcc not found after sourcing $env_sh; run: bash ../shared/cuda/setup-toolchain.sh" >&2
    return 1
  fi
}

# executables CARGO_JSON: "kind<TAB>name<TAB>executable" for every compiler-artifact with an
# executable in cargo's --message-format=json output.
executables() {
  if command -v jq >/dev/null; then
    jq -r 'select(.reason == "compiler-artifact" and .executable != null)
           | [(.target.kind | join(",")), .target.name, .executable] | @tsv' "$1"
  else
    python3 -c '
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(",".join(m["target"]["kind"]), m["target"]["name"], m["executable"], sep="\t")
' "$1"
  fi
}

# pack EXE NAME: a stripped copy of EXE as .gpu/NAME.xz. A copy, because touching cargo's own
# outputs could confuse its freshness checks.
pack() {
  local tmp
  tmp=$(mktemp)
  cp "$1" "$tmp"
  strip "$tmp"
  mkdir -p .gpu
  xz -T2 -6 -c "$tmp" > ".gpu/$2.xz"
  rm -f "$tmp"
}
