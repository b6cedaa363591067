# Two self-sufficient commands: `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs. The CPU torch wheel 2.13.0 is
# installed first, so nothing later can pull another (CUDA) torch.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
BASE := $(VENV)/.installed-base
TEST := $(VENV)/.installed-test

.PHONY: demo test clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(BASE): pyproject.toml | $(PY)
	$(PIP) torch==2.13.0
	$(PIP) -e .
	touch $@

$(TEST): pyproject.toml $(BASE)
	$(PIP) -e '.[test]'
	touch $@

demo: $(BASE)
	$(PY) -m sparsejax demo

test: $(TEST)
	$(PY) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV) build *.egg-info
