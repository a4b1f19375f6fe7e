# The two commands of the README: `make demo` and `make test`. Each sets up what it needs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
export PIP_FIND_LINKS ?= /opt/wheels
export PIP_DISABLE_PIP_VERSION_CHECK = 1

.PHONY: install demo test bench clean

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
	$(VENV)/bin/rstreamer demo --generate

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/rstreamer bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info demo-output bench-output
