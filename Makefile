# Two commands for a newcomer (README.md): `make book` and `make test`.
# Both create the virtual environment in .venv and install requirements.txt first.
# `make lab` sets up only what the notebooks need (requirements-lab.txt: nothing to compile).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
VOCAB  := .vocab

.PHONY: setup lab openblas chromium book test bench clean

setup: $(VENV)/.installed chromium $(VOCAB)/.extracted

# tests/test_book.py drives Debian's Chromium through Playwright (no browser download); checked on
# every setup so an existing .venv still gets it
chromium:
	@if [ -z "$$CHROMIUM" ] && ! [ -x /usr/bin/chromium ]; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
	  else echo "note: tests/test_book.py needs Chromium: apt-get install chromium, or set CHROMIUM=/path/to/chromium"; fi; fi

# MLX's CPU backend on Linux gets the system OpenBLAS, built for every CPU of its architecture
# (ref_impl/platform/blas.py); Debian/Ubuntu ship it as libopenblas0-pthread
openblas:
	@if [ "$$(uname)" = Linux ] && ! ldconfig -p | grep -qE 'libopenblasp?\.so\.0 '; then \
	  if command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libopenblas0-pthread; \
	  else echo "note: install OpenBLAS (apt-get install libopenblas0-pthread; dnf install openblas-threads), or MLX keeps its slow reference BLAS"; fi; fi

# The notebooks, to read and run: MLX, ref_impl, JupyterLab; no compiler, no peer, no browser. A cell that
# needs the peer says so and shows its recorded result.
lab: $(VENV)/.lab $(VOCAB)/.extracted
	@echo "Open a chapter: $(BIN)/jupyter lab book/intro/roofline.ipynb"

$(VENV)/.lab: requirements-lab.txt pyproject.toml | openblas
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install -r requirements-lab.txt
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

$(VENV)/.installed: requirements.txt requirements-lab.txt pyproject.toml | openblas
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# llama-cpp-python builds llama.cpp from source (about 5 minutes on 2 cores), first and on its own:
	@# GGML_NATIVE=OFF builds ggml's portable x86-64 kernels (AVX2, FMA, F16C) rather than -march=native,
	@# which on a virtual CPU that advertises AMX it cannot run dies of an illegal instruction; no pip
	@# cache, because a wheel built elsewhere with other flags would be taken from it unseen; no mtmd
	@# (LLAVA_BUILD: the multimodal library, which nothing here loads)
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc 2>/dev/null || echo 2) \
	  $(BIN)/python -m pip install --no-cache-dir $$(grep '^llama-cpp-python==' requirements.txt)
	$(BIN)/python -m pip install -r requirements.txt
	@# ref_impl importable from anywhere in the venv (notebooks run in book/)
	$(BIN)/python -m pip install --quiet --no-deps -e .
	touch $@

# A virtual environment with pip and nothing else yet: all the vocabularies below need
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# llama.cpp's tokenizer test vocabularies (models/ggml-vocab-*.gguf with their .inp/.out vectors) for
# tests/test_tokenizer_llama_cpp.py and the Your-model page (`make lab` too): taken from the pinned
# llama-cpp-python source package, once. Nothing is compiled: pip reads the package's metadata with its build
# tools as wheels (--no-binary names the one package, where :all: would build those tools from source too)
$(VOCAB)/.extracted: requirements.txt | $(BIN)/python
	rm -rf $(VOCAB) && mkdir -p $(VOCAB)/sdist
	$(BIN)/python -m pip download --quiet --no-binary llama-cpp-python --no-deps -d $(VOCAB)/sdist \
	  $$(grep '^llama-cpp-python==' requirements.txt)
	tar -xzf $(VOCAB)/sdist/*.tar.gz -C $(VOCAB) --strip-components=4 --wildcards '*/vendor/llama.cpp/models/ggml-vocab-*'
	rm -rf $(VOCAB)/sdist
	touch $@

book: setup
	$(BIN)/jupyter-book build . --warningiserror --keep-going
	@echo "The book: _build/html/index.html"

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python -m ref_impl bench

clean:
	rm -rf _build .pytest_cache
