# dpsweep's two commands (Python >= 3.11; no GPU, no internet beyond the package registry):
#   make demo   # set up .venv, then run the main job: DP on/off x two noise levels on digits
#   make test   # set up .venv, then run lint, type checks, the strict docs build and the tests (not -m slow/cluster)
# Both create .venv on first use and reuse it afterwards (re-installed when pyproject.toml changes).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup demo test test-fast test-slow test-all lint docs docs-serve ui clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/dpsweep -m experiment=demo
	@echo "Results are in ./mlflow.db; browse them with: make ui"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python .ci/lint_imports.py

# Three tiers, by pytest marker (pyproject.toml):
#   make test       lint, docs, and every test not marked slow or cluster: under 8 minutes on 2 cores
#   make test-fast  the same tests without lint and docs: the edit-test loop
#   make test-slow  the rest: -m slow (training in subprocesses, sweeps, studies, probes, the browser)
#                   and -m cluster (real Slurm, Grid Engine, PostgreSQL), about 25 minutes on 2 cores
#   make test-all   all three; CI (.ci/run) runs make test, then make test-slow
# One torch thread per process, so that parallel tests do not oversubscribe the cores.
# --no-loadscope-reorder: tests are handed out in tests/conftest.py's order, the longest first.
# --durations=15: the slowest tests, printed at the end, to keep each tier within its time.
PYTEST := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(BIN)/pytest --dist loadgroup --no-loadscope-reorder
QUICK  := -m "not cluster and not slow"

test: lint docs
	$(PYTEST) -n 2 $(QUICK) --durations=15

test-fast: $(STAMP)
	$(PYTEST) -n 2 $(QUICK)

# 3 workers: the scheduler and subprocess tests mostly wait; each scheduler's tests share one worker.
test-slow: $(STAMP)
	$(PYTEST) -n 3 -m "slow or cluster" --durations=15

test-all: test test-slow

# The documentation site (MkDocs + Material, pages in docs/src/), built with warnings as errors into
# docs/site/ (ignored by git). docs/hooks.py generates the config reference from the schema and the
# commands' --help, in seconds, without network or GPU. NO_MKDOCS_2_WARNING: Material's end-of-life
# banner, printed on every build, is not a warning about these docs.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -f docs/mkdocs.yml

docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict -f docs/mkdocs.yml -a 127.0.0.1:8000

# MLflow's UI on ./mlflow.db (127.0.0.1:5000), opened on the latest run's experiment in the model-training
# view (.../#/experiments/<id>?workflowType=machine_learning; MLflow 3 otherwise opens its GenAI view).
ui: $(STAMP)
	$(BIN)/dpsweep-ui

clean:
	rm -rf $(VENV) outputs multirun mlruns mlartifacts mlflow.db mlflow.db.lock optuna.db optuna.db.dpsweep.lock .pytest_cache .mypy_cache .ruff_cache docs/site
