# Sourced by the scripts that run here for the lent GPU (scripts/gpu/stage.sh,
# scripts/bench/candle-patched.sh --stage, sass.sh, sass-same.sh).
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

# sass_tools: sets SASS_BIN to a folder holding cuobjdump and nvdisasm (this machine's CUDA
# has no disassembler): Triton 3.0.0's wheel ships CUDA 12.4's, which read the sm_90a cubins
# nvcc 13 writes; downloaded once into ~/.cache/candle-flash-sass.
sass_tools() {
  local cache=${HOME:-/tmp}/.cache/candle-flash-sass wheel
  SASS_BIN=$cache/triton/backends/nvidia/bin
  if [ ! -x "$SASS_BIN/cuobjdump" ] || [ ! -x "$SASS_BIN/nvdisasm" ]; then
    mkdir -p "$cache"
    python3 -m pip download --quiet --no-deps --dest "$cache" triton==3.0.0 || return 1
    wheel=$(ls "$cache"/triton-3.0.0-*.whl | head -n 1)
    # cuobjdump calls nvdisasm for the SASS.
    python3 -c 'import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); [z.extract("triton/backends/nvidia/bin/" + t, sys.argv[2]) for t in ("cuobjdump", "nvdisasm")]' "$wheel" "$cache" || return 1
    chmod +x "$SASS_BIN/cuobjdump" "$SASS_BIN/nvdisasm"
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
