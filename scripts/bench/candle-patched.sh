#!/usr/bin/env bash
# Runs cargo against candle-core 0.11.1 with docs/upstream/candle-core-first-grad.patch
# applied (the first gradient of a tensor stored instead of added to zeros), for A/B
# measurements only: the crate itself depends on released Candle.
#
# Usage: bash scripts/bench/candle-patched.sh CARGO_ARGS...
#   e.g. CARGO_TARGET_DIR=target-cuda bash scripts/bench/candle-patched.sh \
#          test --release --test cpu_train
#        bash scripts/bench/candle-patched.sh --stage bench:attention example:finetune
#   --stage KIND:NAME...: builds those targets with `--release --features cuda` (the toolchain
#   of ../shared/cuda/env.sh, CARGO_TARGET_DIR defaulting to target-cuda) and stages them as
#   .gpu/bench-NAME-patched.xz / .gpu/example-NAME-patched.xz, beside scripts/gpu/stage.sh's
#   unpatched ones (scripts/bench/autograd-ab.sh, scripts/model/finetune-gpu.sh patched-ab).
# The patched source is prepared in target/candle-patched/ from cargo's registry copy; the
# override goes through `--config patch.crates-io...`. Cargo rewrites Cargo.lock for it while
# the command runs and this script restores it afterwards: commit nothing meanwhile.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

VERSION=0.11.1
PATCH=$PWD/docs/upstream/candle-core-first-grad.patch
DEST=$PWD/target/candle-patched/candle-core-$VERSION

# Offline with the crate already in cargo's registry is fine: the check below decides.
cargo fetch --quiet || true
src=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/candle-core-$VERSION 2>/dev/null | head -n 1)
if [ -z "$src" ]; then
  echo "error: candle-core-$VERSION not in cargo's registry after cargo fetch" >&2
  exit 1
fi
if [ ! -f "$DEST/.patched" ] || [ "$PATCH" -nt "$DEST/.patched" ]; then
  rm -rf "$DEST"
  mkdir -p "$(dirname "$DEST")"
  cp -r "$src" "$DEST"
  patch --quiet -d "$DEST" -p1 < "$PATCH"
  touch "$DEST/.patched"
fi

cp Cargo.lock "$DEST/Cargo.lock.orig"
trap 'cp "$DEST/Cargo.lock.orig" Cargo.lock' EXIT
patched_cargo() { cargo --config "patch.crates-io.candle-core.path=\"$DEST\"" "$@"; }

if [ "${1:-}" != --stage ]; then
  patched_cargo "$@"
  exit
fi
shift
# shellcheck source=scripts/gpu/stage-lib.sh
source scripts/gpu/stage-lib.sh
cuda_toolchain
export CANDLE_FLASH_SASS=${CANDLE_FLASH_SASS:-80,90}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target-cuda}
for target in "$@"; do
  kind=${target%%:*} name=${target#*:}
  case $kind in
    bench | example) ;;
    *) echo "error: --stage takes bench:NAME or example:NAME, not $target" >&2; exit 2 ;;
  esac
  json=$(mktemp)
  patched_cargo build --release --features cuda "--$kind" "$name" \
    --message-format=json-render-diagnostics > "$json"
  # The executable cargo names is the uplifted copy, which the next unpatched build of the
  # same target overwrites: stage it now.
  exe=$(executables "$json" | awk -F'\t' -v k="$kind" -v n="$name" '$1 == k && $2 == n {print $3}' | tail -n 1)
  rm -f "$json"
  [ -n "$exe" ] || { echo "error: no executable for $target in cargo's output" >&2; exit 1; }
  pack "$exe" "$kind-$name-patched"
  echo "staged .gpu/$kind-$name-patched.xz"
done
