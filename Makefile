# Two commands a user needs: `make demo` and `make test`. Everything else is for developers.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint typecheck proto bench fuzz-deep clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,ucx,bench]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m evergreen_trio.demo

lint: $(STAMP)
	$(BIN)/ruff check evergreen_trio tests benchmarks
	$(BIN)/mypy evergreen_trio

test: lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

proto: $(STAMP)
	$(BIN)/python -m evergreen_trio._proto.generate

bench: $(STAMP)
	$(BIN)/python -m benchmarks $(BENCH_ARGS)

fuzz-deep: $(STAMP)
	$(BIN)/python -m pytest -q -m fuzz --hypothesis-profile=deep

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .hypothesis
