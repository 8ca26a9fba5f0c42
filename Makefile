# make serve  - set everything up (first time) and serve the model repository on the embedded default model
# make draft  - distil the draft LM from the target on the standard library's code and HumanEval's training tasks
#               (cached under ~/.cache/spec_decode; served when present; see docs/trained-proposers.md)
# make speculator - train the EAGLE-3 head (speculative_method=eagle3) on the same data from the target's hidden states
#               (cached under ~/.cache/spec_decode; served when present); each tool within 15 minutes on 2 cores;
#               both do nothing when their folder exists (retrain: python -m spec_decode.training.speculator --fresh)
# make test   - set everything up (first time), lint, and run the test suite (unit + integration against a real
#               tritonserver) in two pytest-xdist workers, a test file per worker at a time
# make test-unit - the unit tests alone (no tritonserver; a few minutes); make lint - ruff and mypy alone
# make bench  - the serving suite (perf_analyzer at concurrency 1-8 per method; AIPerf at 1 and 8 through Triton's
#               generate extension and the OpenAI frontend's /v1/completions and /v1/chat/completions;
#               disable_by_batch_size; in-process transformers generate / prompt lookup / assisted generation; JSON +
#               PNG + goals), a repeated HumanEval workload (two passes) through a fresh server per method with the
#               speed goals, a served round's stage breakdown (none and suffix at concurrency 1 and 8), the forward
#               cost against new positions (target and draft LM, with the roofline), the draft's cost, suffix
#               decoding's cache at 10,000 cached responses, the verifier (torch here; Triton kernels where CUDA is
#               available), then the logits processors' cost per step (every one on against
#               off) and the grammar mask, and last the scheduling through three servers (streams' stalls and a long
#               prompt's TTFT with chunked prefill on and off; TTFT of a repeated 1,000-token prefix with prefix
#               caching on and off), and the OpenAI layer's own cost (tokens/s and TTFT through /v1/completions
#               against gRPC at concurrency 1 and 8)
#               (each python -m bench.<name> from the repository root, and client.bench; docs/benchmarks.md)
# make gpu-check - on a GPU machine (no network, nothing installed: python3 with torch, triton, transformers, numpy):
#               the verifier's kernels against the torch path, their bandwidth, and speculative decoding on CUDA with a
#               random ~1.2B Llama (python -m bench.gpu_check, docs/gpus.md; results/gpu_check.json). Without CUDA:
#               its CPU mode, tiny sizes. PYTHONPATH=backend_src:. stands in for an install of the package
# make gpu-bundle - here (needs make setup): build/gpu_day, what travels to a GPU machine beside the repository: a
#               tritonserver with the Python backend from the nvidia-pytriton wheel (xz, ~27 MB), the tokenizer and
#               pure-Python packages the GPU machine lacks (python -m bench.gpu_day.bundle)
# make gpu-day - on a bare GPU machine (build/gpu_day carried), within 9 minutes: the forward's goals in float32 and
#               bfloat16, the served path through that tritonserver with the step models on the GPU, the verifier's
#               kernels, then the rest of gpu-check; each part in its own process, results/gpu_day.json after each,
#               exit 1 naming each part that failed or was skipped (python -m bench.gpu_day, docs/gpus.md). Without
#               CUDA: the same at tiny sizes on a CPU tritonserver
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
export HTTP_PORT GRPC_PORT METRICS_PORT OPENAI_PORT

.PHONY: setup serve draft speculator lint test test-unit bench bench-serving bench-verifier gpu-check gpu-bundle gpu-day \
	client clean

$(STAMP): requirements.txt requirements-serve.txt requirements-nodeps.txt requirements-deploy.txt pyproject.toml scripts/setup.sh scripts/build_suffix_tree.sh
	bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

# Serving trains nothing: the draft LM is built by `make draft` and served when it exists; without it the server
# serves the model-free proposers (ngram, suffix, hybrid over n-gram).
serve: $(STAMP)
	$(PY) -m spec_decode.launcher

draft: $(STAMP)
	$(PY) -m spec_decode.training.draft --if-missing

speculator: $(STAMP)
	$(PY) -m spec_decode.training.speculator --if-missing

# ruff (lint and import order) and mypy (types, basic mode) over the package; settings in pyproject.toml
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Two workers (pytest-xdist; TEST_WORKERS=0 runs in one process), each taking whole files (--dist loadfile: a file's
# module-scoped server starts once); each worker starts the session's server of tests/conftest.py.
# CONTRIBUTING.md#running-them has the timings.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -v --timeout=900 -n $(TEST_WORKERS) --dist loadfile

test: lint
	$(PYTEST) tests

test-unit: lint
	$(PYTEST) tests/unit

bench: $(STAMP)
	bash scripts/setup_bench.sh
	$(PY) -m bench.serving --output results/serving.json
	$(PY) -m client.bench --output results/bench.json
	$(PY) -m bench.round_stages --output results/round_stages.json
	$(PY) -m bench.engine_vs_server --output results/engine_vs_server.json
	$(PY) -m bench.forward_cost --output results/forward_cost.json
	$(PY) -m bench.dtype --output results/dtype.json
	$(PY) -m bench.trees --output results/trees.json
	$(PY) -m bench.greedy_agreement --output results/greedy_agreement.json
	$(PY) -m bench.draft_cost --output results/draft_cost.json
	$(PY) -m bench.suffix_cache --output results/suffix_cache.json
	$(PY) -m bench.verifier --output results/verifier.json
	$(PY) -m bench.processors --output results/processors.json
	$(PY) -m bench.scheduling --output results/scheduling.json
	$(PY) -m bench.openai_cost --output results/openai_cost.json

bench-serving: $(STAMP)
	bash scripts/setup_bench.sh
	$(PY) -m bench.serving --output results/serving.json

bench-verifier: $(STAMP)
	$(PY) -m bench.verifier --output results/verifier.json

# Installs nothing (a GPU machine may have no network): the project's venv when there is one, else python3.
GPU_CHECK_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	PYTHONPATH=backend_src:. $(GPU_CHECK_PY) -m bench.gpu_check --output results/gpu_check.json

gpu-bundle: $(STAMP)
	PYTHONPATH=backend_src:. $(PY) -m bench.gpu_day.bundle --output build/gpu_day

gpu-day:
	PYTHONPATH=backend_src:.:build/gpu_day/site $(GPU_CHECK_PY) -m bench.gpu_day --output results/gpu_day.json

client: $(STAMP)
	$(PY) -m client.generate --url 127.0.0.1:$(GRPC_PORT) --humaneval 1 --max-tokens 128

clean:
	rm -rf $(VENV) .venv-aiperf .venv-genai-perf results
