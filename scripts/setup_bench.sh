#!/usr/bin/env bash
# NVIDIA AIPerf for `make bench` (bench.serving through bench/aiperf.py), in its own venv (.venv-aiperf): aiperf 0.13.0
# (Python >= 3.11) pins huggingface-hub < 2 and psutil 7.0.x, which the serving venv (.venv) must not take.
# (It replaces genai-perf 0.0.16 and its .venv-genai-perf, which `make clean` removes.)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${AIPERF_VENV:-.venv-aiperf}
PYTHON=${PYTHON:-python3.11}
VERSION=0.13.0
if [ "$("$VENV/bin/aiperf" --version 2>/dev/null || true)" != "$VERSION" ]; then
  echo ">> installing aiperf $VERSION into $VENV"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "aiperf==$VERSION"
fi
echo ">> aiperf $("$VENV/bin/aiperf" --version) ready: $VENV/bin/aiperf"
