"""Looking at what a sweep tracked: ``python -m sweep.browse {ui,compare,dashboard} ...``
(``make ui``, ``make compare``, ``make dashboard``).

- ``ui``: tag the grid's experiment for the UI (``sweep.ui_view``), print the URL of its runs,
  then serve ``mlflow ui`` on the store with one worker on up to 8 cores (MLflow's default of
  four, each a whole copy of the app, starved a 2-core machine running a sweep). A tracking
  server (``MLFLOW_TRACKING_URI=http...``) serves its UI already: only the URL is printed.
- ``compare``: two runs or two rows side by side (``sweep.report.compare``).
- ``dashboard``: optuna-dashboard on the LR searches' storage (``$GATED_ATTN_STORAGE``, else
  ``results/optuna.db``), served in this process: the URL, which may hold a password, reaches no
  command line (``ps``) and is printed with the password hidden. The MLflow UI gets its store
  through the environment too (``MLFLOW_BACKEND_STORE_URI``).

Exit status: 0 on success, 2 on bad input (grid, store, ``--runs``) with one line.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from pathlib import Path

from sweep.cli_parser import OneLineParser, whole  # light: argparse, no torch

# The harness's modules (MLflow, matplotlib, pandas: seconds to import) are imported inside
# main, so a Ctrl-C while they load is one line too.


#: Each subcommand and what it does; ``make ui``, ``make compare`` and ``make dashboard`` run them.
COMMANDS = (
    ("ui", "print the URL of the grid's runs in the MLflow UI, then serve the UI"),
    ("compare", "two runs or rows side by side: config keys that differ, metrics, one figure"),
    ("dashboard", "serve optuna-dashboard on the LR searches' storage"),
)


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m sweep.browse",
        description="Look at what a sweep tracked: the MLflow UI, two runs side by side, the LR searches.",
        epilog="Exit status: 0 done; 2 bad input (grid, store, --runs), one line; 130 after Ctrl-C.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in COMMANDS:
        sub.add_parser(name, help=text.replace("%", "%%"), description=text[0].upper() + text[1:] + ".")
    for name in ("ui", "compare"):
        s = sub.choices[name]
        s.add_argument("--grid", default="grids/table1.yaml", help="grid YAML file")
        s.add_argument("--scale", default="tiny", help="scale profile of the grid")
        s.add_argument("--results", default="results", help="results folder (store, figures)")
    port = whole(1, 65535)
    sub.choices["ui"].add_argument("--port", type=port, default=5000, help="the UI's port on 127.0.0.1")
    sub.choices["ui"].add_argument("--print-only", action="store_true", help="print the URL only")
    sub.choices["compare"].add_argument("--runs", required=True, help="two run ids or row ids, a,b")
    board = sub.choices["dashboard"]
    board.add_argument("--results", default="results", help="results folder (results/optuna.db)")
    board.add_argument("--port", type=port, default=8080, help="the dashboard's port on 127.0.0.1")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    results = Path(args.results)
    try:
        if args.command == "dashboard":
            return _dashboard(results, args.port)
        return _browse(args, results)
    except KeyboardInterrupt:  # Ctrl-C while modules load, the store is read or a figure drawn
        print(f"{args.command} interrupted", file=sys.stderr)
        return 130


def _browse(args: argparse.Namespace, results: Path) -> int:
    from sweep.grid import load_grid
    from sweep.gridfile import GridError
    from sweep.report.compare import CompareError
    from sweep.store import Tracker, experiment_name
    from sweep.store_urls import TrackingError, tracking_uri

    try:
        grid = load_grid(args.grid)
        grid.cells(args.scale)  # the scale exists
        uri = tracking_uri(results)
        _existing(uri)
        if args.command == "ui" and not args.print_only and not uri.startswith(("http://", "https://")):
            _refuse_a_taken_port(args.port)  # before the UI's view is tagged: nothing written
        tracker = Tracker(uri, experiment_name(grid.name, args.scale), results / "mlartifacts")
        if args.command == "compare":
            return _compare(args.runs, grid, args.scale, results, tracker)
        return _ui(uri, tracker, grid, args.scale, args.port, args.print_only)
    except (GridError, TrackingError, CompareError, PortTaken) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


class PortTaken(RuntimeError):
    """The port asked for cannot be served here; ``str()`` is the one line."""


def _refuse_a_taken_port(port: int) -> None:
    """Bind 127.0.0.1:``port`` as a server would (``SO_REUSEADDR``), then let it go: a port in use
    is one line now, not the server's traceback after the store was opened.

    Raises:
        PortTaken: in use, or not ours to bind.
    """
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as err:
            why = "is in use" if err.errno == errno.EADDRINUSE else f"cannot be served ({err.strerror})"
            raise PortTaken(f"--port {port}: 127.0.0.1:{port} {why}; give another port") from None


def _existing(uri: str) -> None:
    """Refuse a SQLite store that is missing or empty: browsing it would create an empty one,
    which the next ``make tables`` would take for the real store.

    Raises:
        TrackingError: one line naming the file.
    """
    from sweep.store_urls import TrackingError, missing_sqlite_store

    if lost := missing_sqlite_store(uri):
        db, state = lost
        raise TrackingError(f"tracking store {db} is {state}: nothing to browse (make sweep makes it)")


def _compare(runs: str, grid, scale: str, results: Path, tracker) -> int:
    """Raises:
    CompareError: ``runs`` does not name two different rows or runs.
    """
    from sweep.report.compare import CompareError, load_side, write_compare

    names = [n.strip() for n in runs.split(",") if n.strip()]
    if len(names) != 2 or names[0] == names[1]:
        raise CompareError(f"RUNS: give two different run ids or row ids, a,b; got {runs!r}")
    a, b = (load_side(n, grid, scale, results, tracker.client) for n in names)
    text, figure = write_compare(a, b, tracker.client, results)
    print(f"{a.name} vs {b.name} ({grid.name}, scale {scale})\n\n{text}\nfigure: {figure}")
    return 0


def _ui(uri: str, tracker, grid, scale: str, port: int, print_only: bool) -> int:
    from experiments.names import Kind
    from sweep.passwords import hide_password
    from sweep.ui_view import runs_url

    served = uri.startswith(("http://", "https://"))
    base = uri if served else f"http://127.0.0.1:{port}"
    runs = tracker.client.search_runs([tracker.experiment_id], f"tags.kind = '{Kind.CELL}'", max_results=5000)
    url = runs_url(base, tracker.experiment_id)
    print(f"experiment {tracker.experiment}: {len(runs)} cell run(s); open {hide_password(url)}")
    elsewhere = [
        c
        for c in grid.cells(scale)
        if (run := tracker.done_run(c.run_key)) and run.info.experiment_id != tracker.experiment_id
    ]
    if elsewhere:
        rows = ", ".join(dict.fromkeys(c.row.id for c in elsewhere))
        print(f"  {len(elsewhere)} of its cells were trained for another grid first (rows {rows}):")
        print("  they show in that grid's experiment; make tables reads them")
    if served or print_only:
        return 0
    workers = 1 if (os.cpu_count() or 1) <= 8 else 4
    command = [sys.executable, "-m", "mlflow", "ui", "--host", "127.0.0.1"]
    command += ["--port", str(port), "--workers", str(workers)]
    sys.stdout.flush()
    os.environ["MLFLOW_BACKEND_STORE_URI"] = uri  # not in argv: a database URL may hold a password
    os.environ["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # no job runner and its 8 consumers
    os.execv(sys.executable, command)
    return 0  # not reached


def _dashboard(results: Path, port: int) -> int:
    """Serve optuna-dashboard on 127.0.0.1:``port`` until Ctrl-C (then 130, one line)."""
    from optuna_dashboard import run_server

    from sweep.passwords import hide_password
    from sweep.store_urls import STORAGE_ENV, TrackingError
    from sweep.studies import make_storage, storage_url

    try:
        _refuse_a_taken_port(port)
        url = storage_url(results, os.environ.get(STORAGE_ENV) or None)
        storage = make_storage(url)  # creates the tables of a new file, as the sweep would
    except (ValueError, TrackingError, PortTaken) as err:  # a path a URL cannot hold; no driver, no server
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"optuna-dashboard on {hide_password(url)}: open http://127.0.0.1:{port}/", flush=True)
    try:
        run_server(storage, host="127.0.0.1", port=port)
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
