"""The scoring a sweep (and ``make eval``) runs after training: the benchmarks and the long-context
checks of every finished run that lacks them, one summary line each."""

from __future__ import annotations

import time
from pathlib import Path

from sweep.grid import Cell, Grid


def score_benchmarks(
    grid: Grid, scale: str, cells: list[Cell], results: Path, cache: Path | None, asked: bool = False
) -> int:
    """Benchmark the finished runs that lack scores (after a sweep only at the grid's
    ``eval.scales``; ``make eval`` at any); return how many evaluations failed."""
    if not grid.eval.tasks:
        return 0
    if not asked and not grid.eval.scored_by_sweep(scale):
        where = ", ".join(grid.eval.scales)
        print(f"benchmarks: not scored at {scale} (the grid scores at {where}); make eval scores them")
        return 0
    from sweep.eval.scores import evaluate_missing, runnable_tasks
    from sweep.store import Tracker, experiment_name
    from sweep.store_urls import tracking_uri

    tracker = Tracker(tracking_uri(results), experiment_name(grid.name, scale), results / "mlartifacts")
    spec = grid.eval.for_scale(scale, sweep=not asked)
    started = time.monotonic()
    done, failed = evaluate_missing(tracker, cells, spec, cache)
    if done or failed:
        print(
            f"benchmarks ({', '.join(runnable_tasks(spec))}): {done} runs scored, {failed} failed "
            f"in {time.monotonic() - started:.0f} s"
        )
    return failed


def score_long_context(grid: Grid, scale: str, cells: list[Cell], results: Path, cache: Path | None) -> int:
    """Score the finished runs of the grid's ``longctx.rows`` that lack long-context scores;
    return how many evaluations failed."""
    if grid.longctx is None:
        return 0
    from sweep.eval.longctx_run import score_missing_long_context
    from sweep.store import Tracker, experiment_name
    from sweep.store_urls import tracking_uri

    tracker = Tracker(tracking_uri(results), experiment_name(grid.name, scale), results / "mlartifacts")
    done, failed = score_missing_long_context(tracker, grid, cells, cache)
    if done or failed:
        print(f"long context: {done} runs scored, {failed} failed")
    return failed
