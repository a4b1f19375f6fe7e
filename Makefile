# The two commands of the README: `make demo` and `make test` (and `make lint`, which CI runs first).
# Each sets up what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
export PIP_FIND_LINKS ?= /opt/wheels
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: install demo test lint bench clean
LINT_PATHS := rstreamer webapp workers tests

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, from the pinned CPU wheel, so nothing later pulls another build.
	$(PY) -m pip install -q torch==2.13.0
	# uwsgi builds from source; the test machines have a compiler, so its test runs too.
	$(PY) -m pip install -q -e ".[all,uwsgi]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rstreamer demo $(DEMO_ARGS)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# ruff and mypy read their settings from pyproject.toml; both come with the [lint] extra that [all] pulls.
lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(VENV)/bin/rstreamer bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info demo-output bench-output
