#!/usr/bin/env bash
# genai-perf for `make bench`, in its own venv (.venv-genai-perf): genai-perf 0.0.16 pins packages the serving venv
# must not take (and its PyPI "perf-analyzer" is a placeholder: it calls the perf_analyzer of tritonclient 2.49 that
# scripts/setup.sh installs into .venv, put on PATH by bench.serving).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${GENAI_PERF_VENV:-.venv-genai-perf}
if [ ! -x "$VENV/bin/genai-perf" ]; then
  echo ">> installing genai-perf 0.0.16 into $VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q genai-perf==0.0.16
fi
"$VENV/bin/genai-perf" --version >/dev/null 2>&1 || "$VENV/bin/genai-perf" --help >/dev/null
echo ">> genai-perf ready: $VENV/bin/genai-perf"
