#!/usr/bin/env bash
# Builds the GPU binaries here (no GPU needed) and stages them, stripped and xz-compressed,
# in .gpu/ for the lent GPU machine, which has no Rust. Carry `.gpu` in the `run` call and
# run `bash scripts/gpu/suite.sh` there.
#
# Usage: scripts/gpu/stage.sh [--ptxas | --ptxas-only] [--no-examples]
#   --ptxas        also compile cuda/*.cu to cubin and write the register/spill report
#                  to .gpu/ptxas.txt (PTXAS_ARCH overrides the arch, default sm_90)
#   --ptxas-only   only the ptxas report, no cargo build
#   --no-examples  stage the test binary and the benches only (kernel A/B runs: quicker
#                  to build, less to carry)
# Environment: STAGE_EXAMPLES=llama[,finetune,...] stages only those examples (all of them
# together pass the 60 MiB limit).
#
# Staged names: .gpu/gpu.xz (test target `gpu`), .gpu/bench-NAME.xz, .gpu/example-NAME.xz.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

PTXAS=0 BUILD=1 EXAMPLES=1
for arg in "$@"; do
  case $arg in
    --ptxas) PTXAS=1 ;;
    --ptxas-only) PTXAS=1 BUILD=0 ;;
    --no-examples) EXAMPLES=0 ;;
    *) echo "usage: $0 [--ptxas | --ptxas-only] [--no-examples]" >&2; exit 2 ;;
  esac
done

# shellcheck source=scripts/gpu/stage-lib.sh
source scripts/gpu/stage-lib.sh
cuda_toolchain || exit 1

# Hopper machine code and the sm_80 set (SASS for Ampere, PTX that the H100 JIT-compiles
# under CANDLE_FLASH_ARCH=sm80): the build that serves both, tested on the lent GPU.
export CANDLE_FLASH_SASS=${CANDLE_FLASH_SASS:-80,90}

mkdir -p .gpu
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# A target is a file `DIR/NAME.rs` or a folder with `DIR/NAME/main.rs`.
has_rs() { compgen -G "$1/*.rs" >/dev/null || compgen -G "$1/*/main.rs" >/dev/null; }

if [ "$BUILD" = 1 ]; then
  # One profile (--release) for everything that builds `cuda`: each new profile re-runs
  # candle's 7-minute kernel build. json-render-diagnostics keeps compiler errors readable
  # on stderr while stdout carries the artifact JSON.
  cargo test --release --features cuda --no-run \
    --message-format=json-render-diagnostics > "$TMP/cargo.json"
  extra=()
  # `--bench '*'` rather than `--benches`: the latter also builds the lib's bench harness.
  if has_rs benches; then extra+=(--bench '*'); fi
  if [ "$EXAMPLES" = 1 ] && has_rs examples; then extra+=(--examples); fi
  if [ ${#extra[@]} -gt 0 ]; then
    cargo build --release --features cuda "${extra[@]}" \
      --message-format=json-render-diagnostics >> "$TMP/cargo.json"
  fi

  # The last stage's binaries move to .gpu/prev/ (an A/B of the build before against this
  # one: scripts/bench/ab.sh unpacks them as $BIN/prev-NAME); none stay beside the new ones
  # (stale binaries of renamed or deleted targets). Hand-staged A/B binaries belong in a
  # folder of their own for the same reason.
  mkdir -p .gpu/prev
  if compgen -G ".gpu/*.xz" > /dev/null; then
    rm -f .gpu/prev/*.xz
    mv .gpu/*.xz .gpu/prev/
  fi
  declare -A staged=()
  while IFS=$'\t' read -r kind name exe; do
    case $kind in
      test) [ "$name" = gpu ] || continue; out=gpu ;;
      # The library's unit tests: the catalogue check that loads every kernel on the device.
      lib) [ "$name" = candle_flash ] || continue; out=unit ;;
      bench) out=bench-$name ;;
      # `cargo test --no-run` builds the examples too: staged only when asked for.
      # STAGE_EXAMPLES=llama,finetune keeps to those (each binary carries every kernel:
      # all of them pass the 60 MiB a run can carry).
      example)
        [ "$EXAMPLES" = 1 ] || continue
        [[ -z "${STAGE_EXAMPLES:-}" || ",$STAGE_EXAMPLES," == *",$name,"* ]] || continue
        out=example-$name ;;
      *) continue ;;
    esac
    [ -z "${staged[$out]:-}" ] || continue
    staged[$out]=1
    pack "$exe" "$out"
  done < <(executables "$TMP/cargo.json")

  if [ ! -f .gpu/gpu.xz ]; then
    echo "error: no executable for the test target 'gpu' (tests/gpu.rs) in cargo's output" >&2
    exit 1
  fi

  total=0
  for f in .gpu/*.xz; do
    size=$(stat -c %s "$f")
    total=$((total + size))
    awk -v s="$size" -v f="$f" 'BEGIN { printf "%8.1f MiB  %s\n", s / 1048576, f }'
  done
  awk -v s="$total" 'BEGIN { printf "%8.1f MiB  total\n", s / 1048576 }'
  # The `run` tool carries at most 64 MiB in all; keep room for the working tree.
  if [ "$total" -gt $((60 * 1024 * 1024)) ]; then
    echo "error: staged binaries exceed 60 MiB; stage fewer examples or benches" >&2
    exit 1
  fi
fi

if [ "$PTXAS" = 1 ]; then
  # Register use and spills per kernel, without a GPU: spills to local memory are the
  # first thing to check when a kernel is slower than expected.
  arch=${PTXAS_ARCH:-sm_90}
  : > .gpu/ptxas.txt
  for cu in cuda/*.cu; do
    [ -e "$cu" ] || { echo "no cuda/*.cu files" >&2; break; }
    echo "== $cu ($arch)" >> .gpu/ptxas.txt
    if ! nvcc -cubin -arch="$arch" -O3 --use_fast_math -std=c++17 -Xptxas -v -I cuda \
        -o "$TMP/$(basename "$cu" .cu).cubin" "$cu" > "$TMP/ptxas.log" 2>&1; then
      cat "$TMP/ptxas.log" >&2
      echo "error: nvcc failed on $cu" >&2
      exit 1
    fi
    cat "$TMP/ptxas.log" >> .gpu/ptxas.txt
  done
  echo "ptxas report: .gpu/ptxas.txt ($(grep -c 'Compiling entry function' .gpu/ptxas.txt || true) kernels)"
  # ptxas prints the kernel name on one line and its spill counts on a later one.
  awk '/Compiling entry function/ { fn = $0; sub(/.*function /, "", fn) }
       /spill stores/ && !/ 0 bytes spill stores, 0 bytes spill loads/ {
         print "SPILL " fn ":" $0; n++ }
       END { if (!n) print "no spills" }' .gpu/ptxas.txt
fi
