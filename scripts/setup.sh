#!/usr/bin/env bash
# One-time set-up on a fresh machine: Debian packages, the .venv with pinned dependencies, the package itself,
# Arctic Inference's suffix tree (C++),
# the default target model (converted once to safetensors) and the embedded tritonserver layout.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}

# perf_analyzer (tritonclient 2.49) needs libb64; the embedded server bundles its own libraries.
if ! dpkg -s libb64-0d >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo ">> installing Debian package libb64-0d"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libb64-0d >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo ">> creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
echo ">> installing pinned Python packages into $VENV"
"$VENV/bin/pip" install -q --upgrade pip
"$VENV/bin/pip" install -q -r requirements.txt
"$VENV/bin/pip" install -q --no-deps -r requirements-nodeps.txt
"$VENV/bin/pip" install -q --no-deps -e .
# The Kubernetes manifests' validators and the Dockerfile's linter (tests/unit/deploy), in a venv of their own.
DEPLOY_VENV=${DEPLOY_VENV:-.venv-deploy}
if [ ! -x "$DEPLOY_VENV/bin/python" ]; then
  echo ">> creating $DEPLOY_VENV (kubernetes-validate, checkov, hadolint)"
  "$PYTHON" -m venv "$DEPLOY_VENV"
fi
"$DEPLOY_VENV/bin/pip" install -q -r requirements-deploy.txt
# Suffix decoding's global cache: Arctic Inference's C++ suffix tree, built from its PyPI sdist (cmake, g++).
bash scripts/build_suffix_tree.sh "$VENV/bin/python"

echo ">> preparing the default target model and the embedded tritonserver"
"$VENV/bin/python" - <<'PY'
import shutil
from spec_decode.engine.model_loading import prepare_default_model
from spec_decode.launcher import embedded_server_dir
print("   model:", prepare_default_model())
if shutil.which("tritonserver"):
    print("   tritonserver on PATH:", shutil.which("tritonserver"))
else:
    print("   embedded tritonserver:", embedded_server_dir())
PY
