"""The options of ``python -m sweep.cli`` (:mod:`sweep.cli`), one subcommand per ``make`` target."""

from __future__ import annotations

import argparse
import os

from sweep.store_urls import STORAGE_ENV

#: Each subcommand and what it does, in the order ``--help`` lists them; ``make help`` names the
#: same commands as make targets (``tests/test_cli_help.py`` checks both).
COMMANDS = (
    ("sweep", "train every unfinished cell, then write the tables"),
    ("tables", "write results/<grid>.{md,csv,tex} and the figures from the tracking store"),
    ("budget", "write results/<grid>_budget.{md,csv}: each row's Δ at 25, 50 and 100 % of training"),
    ("params", "print each row's parameters and planned peak memory a GPU (counted, no training)"),
    ("tune", "Optuna search of each row's max learning rate, then results/<grid>_lr_search.*"),
    ("stability", "train each row at every rung of the grid's LR ladder, then results/<grid>_lr_ladder.*"),
    ("worker", "train cells from the sweep's queue until it is empty (started by sweep --workers)"),
    ("eval", "benchmark finished runs that lack scores (the grid's eval.tasks), then the tables"),
    ("data", "build (or check) the corpora of the grid's cells, offline unless --download"),
)
DESCRIPTION = "Train a grid's cells, score them and write the paper's tables from the tracking store."
EPILOG = (
    "Exit status: 0 done; 1 a cell or the machine failed; 2 bad input (one line naming the file, "
    "the row and the key); 130 after Ctrl-C; 143 after SIGTERM. Each command has a make target "
    "(make help); docs/commands.md lists them with every variable."
)


def parser(description: str = DESCRIPTION) -> argparse.ArgumentParser:
    """The command line's parser: the subcommands and their options."""
    from sweep.run.slurm import add_arguments as add_launcher_arguments
    from sweep.studies import HEARTBEAT_S

    p = argparse.ArgumentParser(prog="python -m sweep.cli", description=description, epilog=EPILOG)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in COMMANDS:
        # argparse %-formats help strings (a "100 %" crashed --help); descriptions it prints as they are
        s = sub.add_parser(name, help=text.replace("%", "%%"), description=text[0].upper() + text[1:] + ".")
        grid = "grids/stability.yaml" if name == "stability" else "grids/table1.yaml"
        s.add_argument("--grid", default=grid, help="grid YAML file")
        s.add_argument("--scale", default="tiny", help="scale profile of the grid")
        s.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default: the grid's)")
        s.add_argument("--rows", default=None, help="comma-separated row ids (default: all)")
        s.add_argument("--force", action="store_true", help="retrain cells that already finished")
        s.add_argument("--results", default="results", help="results folder (store, tables)")
        if name in ("sweep", "worker", "tune", "stability"):
            s.add_argument(  # a worker's, and make's, come through the environment (no password in ps)
                "--storage",
                default=os.environ.get(STORAGE_ENV) or None,
                help=f"Optuna RDB URL (default ${STORAGE_ENV}, else results/optuna.db)",
            )
        if name in ("sweep", "worker"):
            s.add_argument("--heartbeat", type=int, default=HEARTBEAT_S, help=argparse.SUPPRESS)
            s.add_argument("--no-system-metrics", action="store_true", help="no MLflow system metrics")
        if name == "sweep":
            s.add_argument(
                "--workers",
                default="1",
                help="workers (one: in this process), or auto (one per CPU core; on a GPU machine, "
                "one per GPU times --cells-per-gpu)",
            )
            s.add_argument(
                "--cells-per-gpu",
                type=int,
                default=1,
                help="workers sharing each GPU (WORKERS=auto; default 1): several small cells per card",
            )
            add_launcher_arguments(s)
        if name == "data":
            s.add_argument(
                "--download", action="store_true", help="download hub sources into the local cache first"
            )
        if name == "tune":
            s.add_argument("--trials", type=int, default=8, help="trials per row (complete or pruned)")
            s.add_argument("--lr-range", default="1e-4,1e-2", help="log-uniform max LR range, lo,hi")
            s.add_argument("--ladder", default=None, help="fixed max LRs, a,b,c (grid sampler)")
        if name == "stability":
            s.add_argument("--ladder", default=None, help="max LRs a,b,c (default: the grid's lr_ladder)")
    _export_parser(sub)
    return p


def _export_parser(sub) -> None:
    s = sub.add_parser(
        "export", help="each finished run as a Hugging Face transformers folder (docs/export.md)"
    )
    s.add_argument("--grid", default="grids/table1.yaml", help="grid YAML file")
    s.add_argument("--scale", default="tiny", help="scale profile of the grid")
    s.add_argument("--results", default="results", help="results folder (store, checkpoints)")
    s.add_argument("--runs", required=True, help="row ids (every seed's finished run) or run ids, a,b")
    s.add_argument("--dest", default=None, help="root of the folders (default <results>/export)")
    s.add_argument("--force", action="store_true", help="replace folders that exist")
    # a string: export refuses what is not a finite number >= 1 in one line (argparse prints its usage)
    s.add_argument("--yarn", default=None, help="write YaRN at this factor into the config")
    s.set_defaults(seeds=None, rows=None)
