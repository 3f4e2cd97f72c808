# Two commands on a fresh machine: `make demo` (set up, then the headline run) and `make test` (set up, then tests).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PYTEST_ARGS ?=

.PHONY: demo test setup lint clean

$(BIN)/harness: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# torch first, pinned exactly: a CPU build of 2.13.0 where one is on disk, and nothing newer.
	$(BIN)/pip install --quiet "torch==2.13.0"
	$(BIN)/pip install --quiet -e ".[dev,docker,tcconfig,hf,tensorboard,wandb]"
	touch $(BIN)/harness

setup: $(BIN)/harness

demo: setup
	$(BIN)/harness run --profile 1gbps --method dilocox

test: setup
	$(BIN)/python -m pytest -q -rs --durations=10 $(PYTEST_ARGS)

# ruff's rules and formatting everywhere; trainers/ruff.toml adds TID251, which bans harness, pyroute2, docker and
# subprocess imports in trainers/.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
