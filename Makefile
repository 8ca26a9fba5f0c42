# make serve  - set everything up (first time) and serve the model repository on the embedded default model
# make test   - set everything up (first time) and run the test suite (unit + integration against a real tritonserver)
# make bench  - serve the default model and benchmark none vs ngram vs in-process transformers on HumanEval,
#               then the verifier (torch path here; Triton kernels too where CUDA is available)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
export HTTP_PORT GRPC_PORT METRICS_PORT

.PHONY: setup serve test bench bench-verifier client clean

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml scripts/setup.sh scripts/build_suffix_tree.sh
	bash scripts/setup.sh
	touch $(STAMP)

setup: $(STAMP)

serve: $(STAMP)
	$(PY) -m spec_decode.server

test: $(STAMP)
	$(PY) -m pytest tests -v --timeout=900

bench: $(STAMP)
	$(PY) -m client.bench --output results/bench.json
	$(PY) bench/verifier.py --output results/verifier.json

bench-verifier: $(STAMP)
	$(PY) bench/verifier.py --output results/verifier.json

client: $(STAMP)
	$(PY) -m client.generate --url 127.0.0.1:$(GRPC_PORT) --humaneval 1 --max-tokens 128

clean:
	rm -rf $(VENV) results
