"""The one entry point the Makefile calls: ``python -m sweep.cli <command> ...``, one command per
``make`` target (:data:`sweep.cli_parser.COMMANDS`).

Exit status: 0 on success; 1 when a cell failed or the machine did (a full disk: one line); 2 on
bad input (grid, store, results folder, corpus) with a one-line message and nothing started, and
2 with one line when the tracking store is gone or fails mid-sweep (what was recorded before
stays); 130 / 143 after Ctrl-C / SIGTERM.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from sweep.cli_parser import parser

# Scoring runs torch on every core: spinning OpenMP threads made a first scoring pass on loaded cores
# 37-88 s instead of 6.2-6.8 s (docs/corpus.md, "Scoring"). Read when torch loads: set before it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


class UsageError(RuntimeError):
    """Bad input that is not in a grid file (a results folder, say)."""


def _writable(results: Path) -> None:
    from sweep.store_urls import check_url_safe

    try:
        check_url_safe(results)
    except ValueError as err:
        raise UsageError(str(err)) from None
    if results.exists() and not results.is_dir():
        raise UsageError(f"{results}: the results folder is a file; name a folder (--results)")
    try:
        results.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=results):
            pass
    except OSError as err:
        raise UsageError(f"{results}: results folder is not writable ({err.strerror})") from None


def _cache_root() -> Path | None:
    """``GATED_ATTN_CACHE`` if set (the corpus and benchmark cache), else the default."""
    return Path(os.environ["GATED_ATTN_CACHE"]) if os.environ.get("GATED_ATTN_CACHE") else None


def _command_line() -> str:
    """The command as the tables, manifests and stored report name it: no password."""
    from sweep.passwords import hide_password

    return hide_password("python -m sweep.cli " + shlex.join(sys.argv[1:]))


def main(argv: list[str] | None = None) -> int:
    """Run one command; see the module docstring for the exit status. The command line is read
    before anything heavy is imported: ``--help`` and a refused flag answer at once."""
    from sweep.signals import Unwound, unwinding

    args = parser().parse_args(argv)  # argparse's refusals: one line, exit 2 (cli_parser.OneLineParser)
    try:
        refuse_bad_numbers(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        with unwinding():
            return _main(args)
    except KeyboardInterrupt as err:  # outside training (which StopRequest handles): loading, scoring, tables
        code = err.exit_code if isinstance(err, Unwound) else 130
        print(
            f"{args.command} {'stopped by SIGTERM' if code == 143 else 'interrupted'}: no "
            "table or figure was half-written; run the same command again to finish",
            file=sys.stderr,
        )
        return code


def refuse_bad_numbers(args: argparse.Namespace) -> None:
    """The checks of the options that argparse's types cannot make alone (a bound another module
    holds, two options together); argparse has parsed every number already.

    Raises:
        UsageError: one line naming the option.
    """
    from sweep.gridfile import MAX_SEEDS  # light: no torch
    from sweep.run.slurm import LauncherError, check_time_limit

    if args.seeds is not None and not 1 <= args.seeds <= MAX_SEEDS:
        raise UsageError(f"--seeds must be 1 to {MAX_SEEDS}, got {args.seeds}")
    if args.rows is not None and not [r for r in args.rows.split(",") if r.strip()]:
        raise UsageError(f"--rows names no row id, got {args.rows!r} (leave it out for every row)")
    launcher = getattr(args, "launcher", "local")
    if launcher != "local" and args.workers is None:
        raise UsageError(f"--launcher {launcher} needs --workers N (the number of jobs)")
    if launcher != "local":
        try:
            check_time_limit(args.time_limit)
        except LauncherError as err:
            raise UsageError(str(err)) from None
    for option in ("lr_range", "ladder"):
        if getattr(args, option, None) is not None:
            _floats(getattr(args, option), option.replace("_", "-"))


def _main(args: argparse.Namespace) -> int:
    # Imported here, not at the top: a Ctrl-C while they load (a second or so) is then one line.
    from experiments.corpus import CorpusDamaged, CorpusError
    from experiments.names import Outcome
    from sweep.eval.after import score_benchmarks, score_long_context
    from sweep.eval.suite import BenchError
    from sweep.grid import load_grid
    from sweep.gridfile import GridError
    from sweep.run.gpus import GpuLayoutError
    from sweep.run.slurm import LauncherError, launcher_for
    from sweep.store_urls import TrackingError
    from sweep.studies import HEARTBEAT_S

    if hasattr(args, "heartbeat") and args.heartbeat is None:
        args.heartbeat = HEARTBEAT_S
    if getattr(args, "no_system_metrics", False):  # the workers inherit it
        from sweep.run.sysmetrics import ENV

        os.environ[ENV] = "0"
    seeds = list(range(args.seeds)) if args.seeds else None
    rows = [r.strip() for r in args.rows.split(",") if r.strip()] if args.rows else None
    results = Path(args.results) if hasattr(args, "results") else None  # params and data write none
    try:
        grid = load_grid(args.grid)
        cells = grid.cells(args.scale, seeds=seeds, rows=rows)
        if args.command == "params":
            from sweep.report.params import print_params

            print_params(grid, args.scale, rows)
            return 0
        if args.command in ("sweep", "worker", "tune", "stability"):
            from sweep.run.placement import check_runnable, job_nodes

            cluster = args.command == "sweep" and args.launcher != "local"  # it sizes the jobs
            check_runnable(grid, cells, None if cluster else job_nodes() if args.command == "worker" else 1)
        if args.command in ("sweep", "tune", "stability"):  # the worker's driver said it
            for line in grid.log_every_notes(cells):
                print(line)
        if results is not None:
            _writable(results)
        if args.command == "export":
            from sweep.export.command import run_export

            return run_export(args, grid, results, _cache_root())
        from sweep.report.write import refuse_a_lost_store, table_paths, write_tables

        table_seeds = seeds or list(grid.seeds)  # the seeds asked for, else the grid's own

        if args.command in ("tables", "eval"):  # before anything opens (and so creates) the store
            refuse_a_lost_store(results, table_paths(grid, args.scale, results, table_seeds)["md"])

        if args.command == "tune":
            return _tune(args, grid, cells, results)
        if args.command == "stability":
            return _stability(args, grid, cells, results)
        if args.command == "tables":
            paths = write_tables(grid, args.scale, results, _command_line(), table_seeds)
            print(f"wrote {', '.join(map(str, paths.values()))}")
            return 0
        if args.command == "budget":
            return _budget(grid, args.scale, results, table_seeds, rows)
        cache = _cache_root()
        if args.command == "data":
            from sweep.run.corpora import build_corpora

            return build_corpora(grid, cells, cache, args.download)
        if args.command == "eval":
            failed = score_benchmarks(grid, args.scale, cells, results, cache, asked=True)
            failed += score_long_context(grid, args.scale, cells, results, cache)
            paths = write_tables(grid, args.scale, results, _command_line(), table_seeds)
            print(f"table: {paths['md']} (also .csv, .tex)")
            return 1 if failed else 0
        from sweep.run.driver import run_queued_sweep
        from sweep.run.summary import summary_line
        from sweep.signals import StopRequest
        from sweep.studies import storage_url

        started = time.perf_counter()
        if args.command == "worker":
            return _worker(args, grid, cells, results, cache)
        train = [c.config.train for c in cells]  # a launcher that cannot serve them: one line
        launch = launcher_for(args, max(t.num_nodes for t in train), max(t.devices for t in train))
        from sweep.run.gpus import sweep_workers

        args.workers = sweep_workers(args.workers, cells, args.cells_per_gpu, local=launch is None)
        for ids in grid.same_config_rows(cells):
            print(f"note: rows {', '.join(ids)} have one config at {args.scale}: trained once, shown in each")
        with StopRequest() as stop:
            try:
                url = storage_url(results, args.storage)
                outcomes = run_queued_sweep(
                    grid, cells, results, args.workers, url, _worker_args(args, url), args.heartbeat,
                    args.force, cache, stop, launch=launch, default_queue=args.storage is None,
                    cells_per_gpu=args.cells_per_gpu,
                )  # fmt: skip
            except (KeyboardInterrupt, SystemExit):  # Ctrl-C before training, or twice
                if stop.signum is None:
                    raise
                print("sweep interrupted; run the same command again to resume", file=sys.stderr)
                return stop.exit_code
        if stop.signum is not None:
            minutes = (time.perf_counter() - started) / 60
            print(f"sweep interrupted after {minutes:.1f} min: {summary_line(outcomes)}")
            print("state saved; run the same command again to resume")
            return stop.exit_code
        try:
            bench_failed = score_benchmarks(grid, args.scale, cells, results, cache)
        except BenchError as err:  # the benchmark data, not the runs: the tables are still written
            print(f"error: {err}", file=sys.stderr)
            bench_failed = 1
        bench_failed += score_long_context(grid, args.scale, cells, results, cache)
        minutes = (time.perf_counter() - started) / 60
        paths = write_tables(grid, args.scale, results, _command_line(), table_seeds)
        print(f"sweep finished in {minutes:.1f} min: {summary_line(outcomes)}")
        for o in outcomes:
            if o.status in (Outcome.FAILED, Outcome.KILLED, Outcome.BUSY):
                print(f"  {o.status}: {o.cell.row.id} seed {o.cell.seed}: {o.note}")
        print(f"table: {paths['md']} (also .csv, .tex); browse the runs with: make ui")
        figures = [str(p) for k, p in paths.items() if k not in ("md", "csv", "tex", "manifest")]
        if figures:
            print(f"figures: {', '.join(figures)}")
        return 1 if bench_failed or any(o.status in (Outcome.FAILED, Outcome.KILLED) for o in outcomes) else 0
    except CorpusDamaged as err:  # the cache on this machine, not the grid
        print(f"error: {err}", file=sys.stderr)
        return 1
    except CorpusError as err:  # the hub's download hint names this grid and scale
        hint = str(err).replace("GRID=<grid> SCALE=<scale>", f"GRID={args.grid} SCALE={args.scale}")
        key = "data.tokenizer" if hint.startswith("tokenizer ") else "data.sources"
        print(f"error: {args.grid}: {key}: {hint}", file=sys.stderr)
        return 2
    except OSError as err:  # the machine, not the input: a full disk, a folder gone (cells record their own)
        where = f"{err.filename}: " if err.filename else ""
        print(f"error: {args.command}: {where}{err.strerror or err}", file=sys.stderr)
        return 1
    except (GridError, TrackingError, UsageError, LauncherError, BenchError, GpuLayoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


def _budget(grid, scale: str, results: Path, seeds: list[int], rows: list[str] | None = None) -> int:
    """``make budget``: ``results/<stem>_budget.{md,csv}`` (:mod:`sweep.report.budget`) of ``rows``
    (``ROWS``; default all) and their references.

    Raises:
        UsageError: no store, or no finished run in it, to report from (nothing is written).
    """
    from sweep.report.budget import write_budget
    from sweep.store_urls import missing_sqlite_store, tracking_uri

    lost = missing_sqlite_store(tracking_uri(results))
    if lost is not None:
        raise UsageError(f"tracking store {lost[0]} is {lost[1]}: nothing to report (make sweep first)")
    try:
        paths = write_budget(grid, scale, results, _command_line(), seeds, rows)
    except ValueError as err:
        raise UsageError(str(err)) from None
    print(f"wrote {', '.join(map(str, paths.values()))}")
    return 0


def _worker_args(args: argparse.Namespace, url: str) -> list[str]:
    """The ``worker`` command line that names the driver's grid, cells, results and queue."""
    out = ["--grid", args.grid, "--scale", args.scale, "--results", args.results]  # the URL: STORAGE_ENV
    out += ["--heartbeat", str(args.heartbeat)] + (["--no-system-metrics"] if args.no_system_metrics else [])
    out += ["--seeds", str(args.seeds)] if args.seeds else []
    return out + (["--rows", args.rows] if args.rows else [])


def _worker(args: argparse.Namespace, grid, cells, results: Path, cache: Path | None) -> int:
    from sweep.run.worker import run_worker
    from sweep.signals import StopRequest
    from sweep.studies import storage_url

    with StopRequest() as stop:
        outcomes = run_worker(
            grid, cells, results, storage_url(results, args.storage), args.heartbeat, cache, stop
        )
    if stop.signum is not None:
        return stop.exit_code
    from experiments.names import Outcome

    return 1 if any(o.status == Outcome.FAILED for o in outcomes) else 0


def _floats(text: str, what: str) -> list[float]:
    """``a,b,c`` as finite positive numbers (``--lr-range``, ``--ladder``).

    Raises:
        UsageError: anything else, naming the option.
    """
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--{what}: expected comma-separated numbers, got {text!r}") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise UsageError(f"--{what}: expected finite positive numbers, got {text!r}")
    if what == "lr-range" and (len(values) != 2 or values[0] >= values[1]):
        raise UsageError(f"--lr-range: expected lo,hi with lo < hi, got {text!r}")
    return values


def _tune(args: argparse.Namespace, grid, cells, results: Path) -> int:
    import optuna

    from sweep.report.lr import write_lr_report

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    lr_range = _floats(args.lr_range, "lr-range")
    ladder = _floats(args.ladder, "ladder") if args.ladder else None
    studies = _studies(args, grid, cells, results, args.trials, tuple(lr_range), ladder)
    if isinstance(studies, int):  # stopped by a signal
        return studies
    paths = write_lr_report(grid, args.scale, studies, results, _command_line(), ladder=bool(ladder))
    print(f"wrote {', '.join(map(str, paths))}; browse the trials with: make ui (or make dashboard)")
    return _failures(studies)


def _studies(
    args: argparse.Namespace, grid, cells, results: Path, trials: int, lr_range, ladder
) -> dict | int:
    """One LR study per chosen row (:func:`sweep.run.search.tune_rows`), by row id; or the exit
    status after Ctrl-C / SIGTERM (one line said).

    Raises:
        UsageError: a later-stage row, or a ladder that does not match the one a study was run with.
    """
    from sweep.run.search import SearchStopped, tune_rows

    try:
        return tune_rows(
            grid, args.scale, cells, trials, results, args.storage, lr_range, ladder, _cache_root()
        )
    except ValueError as err:
        raise UsageError(str(err)) from None
    except SearchStopped as stopped:
        print(
            f"{args.command} interrupted: the running trial stopped and does not count; "
            "run the same command again to complete the budget",
            file=sys.stderr,
        )
        return stopped.code


def _failures(studies: dict) -> int:
    """1 (with a line) when a trial failed and no retry replaced it, else 0."""
    from sweep.run.search import failed_trials

    failed = failed_trials(studies)
    if failed:
        print(f"{failed} trial(s) failed (not diverged): see their status_note in MLflow")
    return 1 if failed else 0


def _stability(args: argparse.Namespace, grid, cells, results: Path) -> int:
    """The stability ladder (Table 2's claim; docs/lr-search.md): every row at every rung of the
    grid's ``lr_ladder`` (or ``--ladder``), never pruned, then ``results/<grid>_lr_ladder.*``."""
    import optuna

    from sweep.report.stability import write_ladder_report

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    ladder = sorted(set(_floats(args.ladder, "ladder"))) if args.ladder else list(grid.lr_ladder)
    if not ladder:
        raise UsageError(f"{grid.file}: lr_ladder: the grid declares no ladder; add one or give --ladder")
    started = time.perf_counter()
    studies = _studies(args, grid, cells, results, len(ladder), (min(ladder), max(ladder)), ladder)
    if isinstance(studies, int):  # stopped by a signal
        return studies
    paths, body = write_ladder_report(grid, args.scale, studies, ladder, results, _command_line())
    minutes = (time.perf_counter() - started) / 60
    print(body, end="")
    print(f"stability ladder finished in {minutes:.1f} min; wrote {', '.join(map(str, paths))}")
    return _failures(studies)


if __name__ == "__main__":
    sys.exit(main())
