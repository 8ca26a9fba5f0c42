#!/usr/bin/env bash
# Build Snowflake Arctic Inference's suffix tree (C++, arctic_inference.suffix_decoding) into the venv.
#
# The PyPI package ships only as an sdist whose full build wants vLLM's toolchain (grpcio-tools, protobuf pins, torch in
# an isolated build env). Its suffix decoding part is a self-contained C++/nanobind extension, so this script downloads
# the pinned sdist with pip, builds csrc/suffix_decoding with cmake + g++ and installs it with the package's own
# Python wrapper (arctic_inference/suffix_decoding/cache.py) into the venv's site-packages. ~20 s on 2 cores.
#
# Usage: scripts/build_suffix_tree.sh [PYTHON]   (default .venv/bin/python; idempotent)
# spec_decode uses it for speculative_method=suffix/hybrid when importable and falls back to its pure-Python trie
# (slower, ~300 B per trie node) otherwise.
set -euo pipefail
PY=${1:-.venv/bin/python}
VERSION=0.3.0
if "$PY" -c "import arctic_inference.suffix_decoding as s, sys; sys.exit(0 if getattr(s, '__spec_decode_build__', '') == '$VERSION' else 1)" 2>/dev/null; then
  echo "   arctic_inference.suffix_decoding $VERSION already built"
  exit 0
fi
for tool in cmake g++; do
  if ! command -v "$tool" >/dev/null; then
    SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    echo ">> installing Debian packages cmake g++"
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq cmake g++ >/dev/null
    break
  fi
done
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
echo ">> building Arctic Inference $VERSION suffix tree (C++) for suffix decoding"
"$PY" -m pip install -q nanobind==2.9.2 setuptools
"$PY" -m pip download -q --no-deps --no-binary :all: --no-build-isolation -d "$WORK" "arctic-inference==$VERSION" \
  2> >(grep -v "is ignored" >&2)
tar -xzf "$WORK/arctic_inference-$VERSION.tar.gz" -C "$WORK"
SRC="$WORK/arctic_inference-$VERSION"
cmake -S "$SRC/csrc/suffix_decoding" -B "$WORK/build" -DPython_EXECUTABLE="$("$PY" -c 'import sys; print(sys.executable)')" \
  -DCMAKE_BUILD_TYPE=Release >"$WORK/cmake.log" 2>&1 || { cat "$WORK/cmake.log"; exit 1; }
cmake --build "$WORK/build" -j"$(nproc)" >>"$WORK/cmake.log" 2>&1 || { tail -40 "$WORK/cmake.log"; exit 1; }
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
DEST="$SITE/arctic_inference"
rm -rf "$DEST"
mkdir -p "$DEST/suffix_decoding"
cp "$SRC/arctic_inference/__init__.py" "$SRC/LICENSE" "$DEST/"
cp "$SRC/arctic_inference/suffix_decoding/__init__.py" "$SRC/arctic_inference/suffix_decoding/cache.py" \
  "$DEST/suffix_decoding/"
cp "$WORK"/build/_C*.so "$DEST/suffix_decoding/"
echo "__spec_decode_build__ = \"$VERSION\"  # built by spec_decode's scripts/build_suffix_tree.sh" \
  >>"$DEST/suffix_decoding/__init__.py"
"$PY" -c "from arctic_inference.suffix_decoding import SuffixDecodingCache; SuffixDecodingCache(64, 4)"
echo "   installed $DEST"
