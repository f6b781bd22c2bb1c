"""The options of ``python -m sweep.cli`` (:mod:`sweep.cli`), one subcommand per ``make`` target.

Light on purpose: it imports no torch, Lightning, MLflow, Optuna or pandas (nor does anything it
imports), so ``--help`` and a refused flag answer before :mod:`sweep.cli` loads them
(``tests/test_cli_help.py`` checks). Each command offers only the options it acts on
(:data:`OPTIONS`), and a refusal is one line (:class:`OneLineParser`), exit status 2.
"""

from __future__ import annotations

import argparse
import math
import os
from typing import NoReturn

from sweep.store_urls import STORAGE_ENV

#: Each subcommand and what it does, in the order ``--help`` lists them; ``make help`` names the
#: same commands as make targets (``tests/test_cli_help.py`` checks both).
COMMANDS = (
    ("sweep", "train every unfinished cell, then write the tables"),
    ("tables", "write results/<table>.{md,csv,tex} and the figures from the tracking store"),
    ("budget", "write results/<table>_budget.{md,csv}: each row's Δ at 25, 50 and 100 % of training"),
    ("params", "print each row's parameters and planned peak memory a GPU (counted, no training)"),
    ("tune", "Optuna search of each row's max learning rate, then results/<table>_lr_search.*"),
    ("stability", "train each row at every rung of the grid's LR ladder, then results/<table>_lr_ladder.*"),
    ("worker", "train cells from the sweep's queue until it is empty (started by sweep --workers)"),
    ("eval", "benchmark finished runs that lack scores (the grid's eval.tasks), then the tables"),
    ("data", "build (or check) the corpora of the grid's cells, offline unless --download"),
    ("export", "write finished runs as Hugging Face transformers folders (docs/export.md)"),
)
#: The options each command takes besides ``--grid`` and ``--scale``: those it acts on, no other.
OPTIONS = {
    "sweep": ("rows", "seeds", "force", "results", "storage", "heartbeat", "system_metrics", "workers"),
    "tables": ("rows", "seeds", "results"),
    "budget": ("rows", "seeds", "results"),
    "params": ("rows",),
    "tune": ("rows", "results", "storage", "trials", "lr_range", "ladder"),
    "stability": ("rows", "results", "storage", "ladder"),
    "worker": ("rows", "seeds", "results", "storage", "heartbeat", "system_metrics"),
    "eval": ("rows", "seeds", "results"),
    "data": ("rows", "download"),
    "export": ("results", "runs", "dest", "force", "yarn"),
}
DESCRIPTION = "Train a grid's cells, score them and write the paper's tables from the tracking store."
EPILOG = (
    "Exit status: 0 done; 1 a cell or the machine failed; 2 bad input (one line naming the file, "
    "the row and the key); 130 after Ctrl-C; 143 after SIGTERM. Each command has a make target "
    "(make help); docs/commands.md lists them with every variable. <table> is the table's file "
    "name: the grid's name, then _<scale> at a scale other than tiny, then _seeds<N> for N seeds "
    "other than the grid's."
)
MAX_WORKERS = 1024  # each a Python process holding torch: far beyond any machine's, or queue's, use
MAX_CELLS_PER_GPU = 64  # a GPU's memory split 64 ways is about 1 GiB a cell
MAX_HEARTBEAT_S = 3600


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose refusals are one line, ``error: <program>: <what>``, exit status 2
    (argparse's own prints the usage first); its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message}\n")

    def parse_args(  # type: ignore[override]
        self, args: list[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """argparse's, with an option the command does not take named with the command (argparse
        names the program alone)."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            command = f"{self.prog} {parsed.command}" if getattr(parsed, "command", None) else self.prog
            self.exit(
                2, f"error: {command}: does not take {' '.join(extras)} (its --help lists what it takes)\n"
            )
        return parsed


def whole(low: int, high: int | None = None):
    """An argparse ``type``: a whole number from ``low`` to ``high`` (None: no bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            bound = f"from {low} to {high:,}" if high is not None else f"of at least {low}"
            raise argparse.ArgumentTypeError(f"must be a whole number {bound}, got {text!r}")
        return value

    return parse


def workers(text: str) -> int | None:
    """``--workers``: a count, or None for ``auto`` (resolved from the cells:
    :func:`sweep.run.gpus.auto_workers`)."""
    if text == "auto":
        return None
    try:
        return whole(1, MAX_WORKERS)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"must be auto or a whole number from 1 to {MAX_WORKERS:,}, got {text!r}"
        ) from None


def parser(description: str = DESCRIPTION) -> argparse.ArgumentParser:
    """The command line's parser: the subcommands and their options."""
    p = OneLineParser(prog="python -m sweep.cli", description=description, epilog=EPILOG)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in COMMANDS:
        # argparse %-formats help strings (a "100 %" crashed --help); descriptions it prints as they are
        s = sub.add_parser(name, help=text.replace("%", "%%"), description=text[0].upper() + text[1:] + ".")
        grid = "grids/stability.yaml" if name == "stability" else "grids/table1.yaml"
        s.add_argument("--grid", default=grid, help="grid YAML file")
        s.add_argument("--scale", default="tiny", help="scale profile of the grid")
        for option in OPTIONS[name]:
            _OPTIONS[option](s, name)
        s.set_defaults(**{o: None for o in ("rows", "seeds") if o not in OPTIONS[name]})
    return p


def _rows(s: argparse.ArgumentParser, command: str) -> None:
    s.add_argument("--rows", default=None, help="comma-separated row ids (default: all)")


def _seeds(s: argparse.ArgumentParser, command: str) -> None:
    s.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 (default: the grid's)")


def _force(s: argparse.ArgumentParser, command: str) -> None:
    what = "replace folders that exist" if command == "export" else "retrain cells that already finished"
    s.add_argument("--force", action="store_true", help=what)


def _results(s: argparse.ArgumentParser, command: str) -> None:
    what = "store, checkpoints" if command == "export" else "store, tables"
    s.add_argument("--results", default="results", help=f"results folder ({what})")


def _storage(s: argparse.ArgumentParser, command: str) -> None:
    s.add_argument(  # a worker's, and make's, come through the environment (no password in ps)
        "--storage",
        default=os.environ.get(STORAGE_ENV) or None,
        help=f"Optuna RDB URL (default ${STORAGE_ENV}, else results/optuna.db)",
    )


def _heartbeat(s: argparse.ArgumentParser, command: str) -> None:
    # seconds; default sweep.studies.HEARTBEAT_S, filled in by sweep.cli (Optuna loads with it)
    s.add_argument("--heartbeat", type=whole(1, MAX_HEARTBEAT_S), default=None, help=argparse.SUPPRESS)


def _system_metrics(s: argparse.ArgumentParser, command: str) -> None:
    s.add_argument("--no-system-metrics", action="store_true", help="no MLflow system metrics")


def _workers(s: argparse.ArgumentParser, command: str) -> None:
    from sweep.run.slurm import add_arguments as add_launcher_arguments  # no torch: see the module

    s.add_argument(
        "--workers",
        type=workers,
        default="1",
        help="workers (one: in this process), or auto (one per CPU core; on a GPU machine, "
        "one per GPU times --cells-per-gpu)",
    )
    s.add_argument(
        "--cells-per-gpu",
        type=whole(1, MAX_CELLS_PER_GPU),
        default=1,
        help="workers sharing each GPU (WORKERS=auto; default 1): several small cells per card",
    )
    add_launcher_arguments(s)


def _download(s: argparse.ArgumentParser, command: str) -> None:
    s.add_argument("--download", action="store_true", help="download hub sources into the local cache first")


def _trials(s: argparse.ArgumentParser, command: str) -> None:
    s.add_argument("--trials", type=whole(1), default=8, help="trials per row (complete or pruned)")


def _lr_range(s: argparse.ArgumentParser, command: str) -> None:
    s.add_argument("--lr-range", default="1e-4,1e-2", help="log-uniform max LR range, lo,hi")


def _ladder(s: argparse.ArgumentParser, command: str) -> None:
    what = "fixed max LRs, a,b,c (grid sampler)"
    if command == "stability":
        what = "max LRs a,b,c (default: the grid's lr_ladder)"
    s.add_argument("--ladder", default=None, help=what)


def _runs(s: argparse.ArgumentParser, command: str) -> None:
    s.add_argument("--runs", required=True, help="row ids (every seed's finished run) or run ids, a,b")


def _dest(s: argparse.ArgumentParser, command: str) -> None:
    s.add_argument("--dest", default=None, help="root of the folders (default <results>/export)")


def yarn_factor(text: str) -> str:
    """An argparse ``type``: a finite number of at least 1, kept as written (export reads it)."""
    try:
        ok = math.isfinite(float(text)) and float(text) >= 1
    except ValueError:
        ok = False
    if not ok:  # make export YARN=... names the variable the user set
        raise argparse.ArgumentTypeError(f"YARN: the factor must be a finite number >= 1, got {text}")
    return text


def _yarn(s: argparse.ArgumentParser, command: str) -> None:
    s.add_argument(
        "--yarn", type=yarn_factor, default=None, help="write YaRN at this factor (>= 1) in the config"
    )


_OPTIONS = {
    "rows": _rows, "seeds": _seeds, "force": _force, "results": _results, "storage": _storage,
    "heartbeat": _heartbeat, "system_metrics": _system_metrics, "workers": _workers, "download": _download,
    "trials": _trials, "lr_range": _lr_range, "ladder": _ladder, "runs": _runs, "dest": _dest, "yarn": _yarn,
}  # fmt: skip
