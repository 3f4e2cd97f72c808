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
	$(BIN)/pip install --quiet -e ".[dev,docker,tcconfig,hf,tensorboard,wandb,ft]"
	touch $(BIN)/harness

setup: $(BIN)/harness

demo: setup
	$(BIN)/harness run --profile 1gbps --method dilocox

# Two phases: every test on every core (pytest-xdist; the Docker engine's tests one at a time, by a lock), then the
# ones marked `alone` one at a time - they time a real link, a delay or a deadline, which other tests beside them
# would blur. Tests that kill, signal or clean up a run act on its run key only, so they run in the first phase. Each
# phase runs (a red first phase still shows the second's); exit status 5 (PYTEST_ARGS selected none of a phase's
# tests) is no failure.
test: setup
	@status=0; \
	$(BIN)/python -m pytest -q -rs -m "not alone" -n auto --durations=10 $(PYTEST_ARGS) || [ $$? -eq 5 ] || status=1; \
	$(BIN)/python -m pytest -q -rs -m alone --durations=10 $(PYTEST_ARGS) || [ $$? -eq 5 ] || status=1; \
	exit $$status

# ruff's rules and formatting everywhere; trainers/ruff.toml adds TID251, which bans harness, pyroute2, docker and
# subprocess imports in trainers/.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
