"""``make tables``: the table files and figures of one grid at one scale, from the tracking store."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd

from sweep.grid import Grid
from sweep.gridcheck import paper_csv
from sweep.report.curves import curves_markdown, mean_curves, metric_curves, side_of_reference
from sweep.report.display import display_table, markdown
from sweep.report.figures import draw_curve_figures, draw_figures
from sweep.report.headline import redraw_if_input
from sweep.report.longctx import (
    build_longctx_table,
    longctx_figure,
    longctx_markdown,
    longctx_scores,
    task_block,
    tasks_of,
)
from sweep.report.manifest import provenance, provenance_line, stage_manifest
from sweep.report.publish import Staging
from sweep.report.runs import finished_runs, one_arithmetic
from sweep.report.tables import bench_columns, build_table
from sweep.store import Tracker, experiment_name
from sweep.store_urls import TrackingError, missing_sqlite_store, tracking_uri


def table_paths(grid: Grid, scale: str, results_dir: Path, seeds: list[int] | None = None) -> dict[str, Path]:
    """``results/<grid>.{md,csv,tex}`` at the default ``tiny`` scale, ``<grid>_<scale>.*`` otherwise;
    ``_seeds<N>`` is added for ``seeds`` other than the grid's own (``SEEDS=3`` on a 1-seed grid:
    ``table1_seeds3.*``), so a longer run's table sits beside the default one."""
    stem = grid.name if scale == "tiny" else f"{grid.name}_{scale}"
    if seeds is not None and tuple(seeds) != tuple(grid.seeds):
        stem += f"_seeds{len(seeds)}"
    return {ext: results_dir / f"{stem}.{ext}" for ext in ("md", "csv", "tex")}


def refuse_a_lost_store(results_dir: Path, md: Path) -> None:
    """Refuse to report from a SQLite store that is missing or empty (deleted, or cut to nothing)
    while the table ``md`` was made from runs (its manifest says how many): the report would
    replace it with "not run" rows. A store that never held runs reports them as "not run".

    Raises:
        TrackingError: one line naming the store and the table.
    """
    lost = missing_sqlite_store(tracking_uri(results_dir))
    if lost is None or not md.is_file():
        return
    db, state = lost
    try:
        runs = json.loads(md.with_name(f"{md.stem}.manifest.json").read_text()).get("runs", 0)
    except (OSError, ValueError, AttributeError):
        return
    if runs:
        raise TrackingError(
            f"tracking store {db} is {state}, but {md} was made from "
            f"{runs} run(s): not replaced by an empty table (restore the store, or delete {md.name} "
            "to write one)"
        )


def write_tables(
    grid: Grid, scale: str, results_dir: Path, command: str, seeds: list[int] | None = None
) -> dict[str, Path]:
    """Write the table files and the figures (``results/figures/``) from the tracking store, all
    or nothing (:class:`~sweep.report.publish.Staging`: an interrupt or error before the end
    leaves the previous files as they were); then upload them to the experiment's ``report`` run.

    Returns:
        The written paths by extension (tables) and by name (figures).
    """
    refuse_a_lost_store(results_dir, table_paths(grid, scale, results_dir, seeds)["md"])
    runs, left_out = one_arithmetic(finished_runs(grid, scale, results_dir, seeds))
    left_note = _left_out_note(grid, scale, runs, left_out)
    if left_note:
        print(f"note: {left_note.strip()}")
    tracker = Tracker(tracking_uri(results_dir), experiment_name(grid.name, scale))
    if grid.longctx is not None:
        return write_longctx_tables(grid, scale, runs, results_dir, command, tracker, left_note)
    mean = mean_curves(metric_curves(runs, tracker.client), grid) if len(runs) else pd.DataFrame()
    table = build_table(grid, scale, runs)
    sides = side_of_reference(mean, grid)
    table["vs_reference_last_half"] = [sides.get(r, "") for r in table["id"]]
    shown = display_table(table, grid.columns, bench_columns(grid, scale, runs), grid.share_of)
    paths = table_paths(grid, scale, results_dir, seeds)
    stem = paths["md"].stem
    figures: dict[str, Path] = {}
    origin = provenance_line(provenance(runs))
    with Staging(results_dir) as staging:
        staging.text(paths["md"], markdown(grid, scale, table, shown, command, origin) + left_note)
        staging.text(paths["csv"], table.to_csv(index=False, float_format="%.6g"))
        staging.text(paths["tex"], shown.to_latex(index=False, escape=True))
        curves_md, curves_csv = results_dir / f"{stem}_curves.md", results_dir / f"{stem}_curves.csv"
        if mean.empty:  # no run to draw from now: an earlier report's curves are not this table's
            staging.remove(curves_md)
            staging.remove(curves_csv)
        else:
            paths["curves_md"] = staging.text(curves_md, curves_markdown(grid, scale, mean, command))
            paths["curves_csv"] = staging.text(curves_csv, mean.to_csv(float_format="%.6g"))
        for name, fig in _drawn(runs, mean, grid, tracker).items():
            path = results_dir / "figures" / f"{stem}_{name}.png"
            if fig is None:
                staging.remove(path)
            else:
                figures[name] = staging.figure(path, fig)
        paths["manifest"] = stage_manifest(
            staging, paths["md"], command, [*paths.values(), *figures.values()], runs
        )
    store_copies(tracker, paths, figures)
    redraw_if_input(results_dir, paths["csv"])
    return {**paths, **figures}


def _drawn(runs: pd.DataFrame, mean: pd.DataFrame, grid: Grid, tracker: Tracker) -> dict:
    """Every figure of a table by name, None where the runs do not support it or where drawing
    failed (a run without a metric the figure reads): one warning line, never the tables."""
    drawers = {
        "figures": lambda: draw_figures(runs, tracker.client),
        "curve figures": lambda: draw_curve_figures(grid, runs, mean, tracker.client),
    }
    drawn: dict = {}
    for what, draw in drawers.items():
        try:
            drawn.update(draw())
        except Exception as err:  # the report never crashes after the cells trained
            first = (str(err).strip().splitlines() or [""])[0][:200]
            print(f"warning: {what} not drawn: {type(err).__name__}: {first}", file=sys.stderr)
    return drawn


def write_longctx_tables(
    grid: Grid, scale: str, runs: pd.DataFrame, results_dir: Path, command: str, tracker: Tracker, note: str
) -> dict[str, Path]:
    """Table 5's files (``sweep.report.longctx``): scores by evaluation length with and without
    YaRN, and the figure ``<stem>_longctx.png``; all or nothing, as :func:`write_tables`."""
    table = build_longctx_table(grid, scale, longctx_scores(runs, grid), paper_by_method(grid.paper_table))
    paths = table_paths(grid, scale, results_dir)
    figures: dict[str, Path] = {}
    with Staging(results_dir) as staging:
        staging.text(
            paths["md"],
            longctx_markdown(grid, scale, table, command, provenance_line(provenance(runs))) + note,
        )
        staging.text(paths["csv"], table.to_csv(index=False, float_format="%.6g"))
        main = (
            task_block(table, tasks_of(table.rename(columns={"mean": "value"}))[0]) if len(table) else table
        )
        staging.text(paths["tex"], main.to_latex(index=False, escape=True))
        fig = longctx_figure(table) if len(table) else None
        if fig is not None:
            figures["longctx"] = staging.figure(
                results_dir / "figures" / f"{paths['md'].stem}_longctx.png", fig
            )
        paths["manifest"] = stage_manifest(
            staging, paths["md"], command, [*paths.values(), *figures.values()], runs
        )
    store_copies(tracker, paths, figures)
    return {**paths, **figures}


def store_copies(tracker: Tracker, paths: dict[str, Path], figures: dict[str, Path]) -> None:
    """Upload the written files to the experiment's ``report`` run. A store that refuses (read
    only, gone away) costs the copies, not the files already written: one warning line."""
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    try:
        report = tracker.report_run()
        tracker.log_files(report, list(paths.values()), "tables")
        tracker.log_files(report, list(figures.values()), "figures")
    except (MlflowException, SQLAlchemyError, OSError) as err:
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        print(
            f"warning: the tables are written, but the tracking store refused their copies ({first})",
            file=sys.stderr,
        )


def paper_by_method(name: str | None) -> pd.DataFrame | None:
    """A paper table indexed by its ``method`` column (Table 5), or None (none, or no such column)."""
    table = pd.read_csv(paper_csv(name)) if name else None
    return table.set_index("method") if table is not None and "method" in table.columns else None


def _left_out_note(grid: Grid, scale: str, runs: pd.DataFrame, left_out: pd.DataFrame) -> str:
    """A line under the table naming the runs left out for their arithmetic, with the command
    that retrains them (none left out: empty)."""
    if left_out.empty:
        return ""
    cells = ", ".join(f"{r.row} s{r.seed} ({r.arithmetic})" for r in left_out.itertuples())
    rows = ",".join(dict.fromkeys(left_out["row"]))
    seeds = int(left_out["seed"].max()) + 1
    retrain = f"make sweep GRID={grid.file} SCALE={scale} ROWS={rows} SEEDS={seeds} FORCE=1"
    kept = runs["arithmetic"].iloc[0]
    return (
        f"\nLeft out: {cells}: computed otherwise than the table's other runs ({kept}), so their "
        f"numbers would not compare to the last digits. `{retrain}` retrains them here.\n"
    )
