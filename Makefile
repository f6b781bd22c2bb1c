# One entry point per task; every target sets up .venv by itself on a fresh machine.
# Variables, used the same way by every target:
#   GRID  grid file            (default grids/table1.yaml)
#   SCALE tiny | small | paper (default tiny)
#   SEEDS number of seeds      (default: the grid's own)
#   ROWS  comma-separated row ids (default: all)
#   FORCE 1 retrains finished cells
#   WORKERS  cells trained at once (default 1; >1 goes through the Optuna queue in STORAGE)
#   STORAGE  Optuna RDB URL for the sweep's queue and the LR search (default results/optuna.db)
GRID  ?= grids/table1.yaml
SCALE ?= tiny
SEEDS ?=
ROWS  ?=
FORCE ?=
PORT  ?= 5000
TRIALS ?= 8
WORKERS ?= 1
STORAGE ?=
DASHBOARD_PORT ?= 8080
# A CPU build of torch here; any CUDA build >= 2.5 works elsewhere (TORCH_SPEC="torch" or preinstalled).
# TORCH_SPEC only matters when .venv has no torch yet (`make clean` first to switch builds).
TORCH_SPEC ?= torch==2.13.0
PYTHON ?= python3

VENV := .venv
PY   := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS := --grid $(GRID) --scale $(SCALE) $(if $(SEEDS),--seeds $(SEEDS)) $(if $(ROWS),--rows $(ROWS)) $(if $(FORCE),--force)

.PHONY: setup sweep eval tables params tune dashboard throughput throughput-moe bench bench-moe ui test lint clean
setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

sweep: $(STAMP)
	$(PY) -m sweep.cli sweep $(ARGS) --workers $(WORKERS) $(if $(STORAGE),--storage '$(STORAGE)')

eval: $(STAMP)
	$(PY) -m sweep.cli eval $(ARGS)

tables: $(STAMP)
	$(PY) -m sweep.cli tables $(ARGS)

params: $(STAMP)
	$(PY) -m sweep.cli params $(ARGS)

tune: $(STAMP)
	$(PY) -m sweep.cli tune $(ARGS) --trials $(TRIALS) $(if $(STORAGE),--storage '$(STORAGE)')

dashboard: $(STAMP)
	$(VENV)/bin/optuna-dashboard '$(or $(STORAGE),sqlite:///results/optuna.db)' --host 127.0.0.1 --port $(DASHBOARD_PORT)

# training tokens/s of the baseline against gated rows, measured in one process (sweep/throughput.py)
throughput: $(STAMP)
	$(PY) -m sweep.throughput --grid $(GRID) --scale $(SCALE) $(if $(ROWS),--rows $(ROWS))

# tokens/s of the MoE base against a dense model of the same active parameters, same process
throughput-moe: $(STAMP)
	$(PY) -m sweep.throughput --grid grids/table1.yaml --scale $(SCALE) --rows baseline --dense-twin

# the names of one release ago
bench: throughput
bench-moe: throughput-moe

ui: $(STAMP)
	$(VENV)/bin/mlflow ui --backend-store-uri "$${MLFLOW_TRACKING_URI:-sqlite:///results/mlflow.db}" --host 127.0.0.1 --port $(PORT)

test: $(STAMP)
	$(PY) -m pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .cache results/mlflow.db results/mlartifacts results/runs results/checkpoints results/optuna.db
