# `make test` and `make demo` work on a fresh machine: they create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# CPU wheels of torch when the machine has no NVIDIA GPU (the CUDA build is several GB).
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC := $(if $(HAS_GPU),torch,torch==2.13.0)

.PHONY: test demo install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,bench,hf]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not gpu" tests

demo: $(STAMP)
	$(VENV)/bin/turboattn demo

clean:
	rm -rf $(VENV)
