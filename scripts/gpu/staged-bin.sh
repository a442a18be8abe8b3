# Sourced by the scripts that run ON the lent GPU machine: the binaries that
# scripts/gpu/stage.sh put in .gpu/ (xz-compressed), unpacked once into $BIN.
# shellcheck shell=bash

BIN=${CANDLE_FLASH_BIN:-/tmp/candle-flash-bin}

# staged_bin NAME [XZ]: makes $BIN/NAME from XZ (default .gpu/NAME.xz) unless an unpacked
# copy at least as new is there (a fresh .gpu/ on a warm machine wins); fails if neither
# exists.
staged_bin() {
  local name=$1 xz=${2:-.gpu/$1.xz}
  mkdir -p "$BIN"
  if [ -f "$xz" ] && { [ ! -x "$BIN/$name" ] || [ "$xz" -nt "$BIN/$name" ]; }; then
    xz -dc "$xz" > "$BIN/$name" && chmod +x "$BIN/$name" || return 1
  fi
  if [ ! -x "$BIN/$name" ]; then
    echo "error: neither $BIN/$name nor $xz: run scripts/gpu/stage.sh here and carry .gpu" >&2
    return 1
  fi
}
