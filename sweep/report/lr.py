"""The learning-rate search report: ``results/<grid>_lr_search.{md,csv}`` and
``figures/<grid>_lr_sensitivity.png``."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import optuna
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from experiments import names as N
from experiments.names import Status, TrialOutcome
from sweep.grid import Grid, Row
from sweep.report.display import markdown_table
from sweep.report.manifest import stage_manifest
from sweep.report.publish import Staging
from sweep.report.runs import finished_runs
from sweep.studies import trial_table


def _trials(study: optuna.Study) -> pd.DataFrame:
    """:func:`trial_table` as a frame (with its columns even when the study is empty)."""
    return pd.DataFrame(trial_table(study), columns=["trial", "max_lr", "state", "avg_ppl"])


def lr_table(grid: Grid, scale: str, studies: dict[str, optuna.Study], results_dir: Path) -> pd.DataFrame:
    """One line per row: best LR and Avg PPL, the Avg PPL of the sweep's own run (the grid's LR,
    seed 0, if the sweep has one), and the trial counts by state."""
    own = finished_runs(grid, scale, results_dir, seeds=[0])
    own = own[own["status"] == Status.FINISHED].set_index("row") if len(own) else own
    lines = []
    for row in grid.rows:
        if row.id not in studies:
            continue
        trials = _trials(studies[row.id])
        complete = trials[trials["state"] == TrialOutcome.COMPLETE]
        best = complete.loc[complete["avg_ppl"].idxmin()] if len(complete) else None
        lines.append(
            {
                "row": row.id,
                "label": row.label,
                "best_max_lr": best["max_lr"] if best is not None else math.nan,
                "best_avg_ppl": best["avg_ppl"] if best is not None else math.nan,
                "grid_max_lr": grid.resolve(scale, row, 0).train.max_lr,
                "grid_avg_ppl": own.loc[row.id, N.VAL_PPL_AVG]
                if row.id in getattr(own, "index", [])
                else math.nan,
                **{f"n_{s}": int((trials["state"] == s).sum()) for s in TrialOutcome.ALL},
            }
        )
    return pd.DataFrame(lines)


def lr_figure(grid: Grid, studies: dict[str, optuna.Study]) -> Figure:
    """Avg PPL against max LR (log axis), one line per row; diverged trials as x on the top edge."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    rows: list[Row] = [r for r in grid.rows if r.id in studies]
    tops = []
    for row in rows:
        trials = _trials(studies[row.id])
        done = trials[trials["state"] == TrialOutcome.COMPLETE].sort_values("max_lr")
        line = ax.plot(done["max_lr"], done["avg_ppl"], marker="o", label=row.label)[0]
        tops.append((trials[trials["state"] == TrialOutcome.DIVERGED]["max_lr"], line.get_color()))
    top = ax.get_ylim()[1]
    for lrs, color in tops:
        ax.scatter(lrs, np.full(len(lrs), top), marker="x", color=color, s=60, clip_on=False)
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.2g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap on a narrow range
    ax.set(xlabel="max learning rate", ylabel="final Avg PPL", title="LR sensitivity (x: diverged)")
    ax.legend(fontsize=8)
    return fig


def write_lr_report(
    grid: Grid,
    scale: str,
    studies: dict[str, optuna.Study],
    results_dir: Path,
    command: str,
    ladder: bool = False,
) -> list[Path]:
    """Write the table (Markdown and CSV) and the figure (``<grid>_lr_search[_ladder][_<scale>].*``,
    ``figures/<grid>_lr_sensitivity[_ladder][_<scale>].png``), all or nothing; return their paths."""
    table = lr_table(grid, scale, studies, results_dir)
    suffix = ("_ladder" if ladder else "") + ("" if scale == "tiny" else f"_{scale}")
    md, csv = (results_dir / f"{grid.name}_lr_search{suffix}.{ext}" for ext in ("md", "csv"))
    shown = table.copy()
    for col in ("best_max_lr", "grid_max_lr"):
        shown[col] = [f"{v:.2e}" if not math.isnan(v) else "—" for v in table[col]]
    for col in ("best_avg_ppl", "grid_avg_ppl"):
        shown[col] = [f"{v:.2f}" if not math.isnan(v) else "—" for v in table[col]]
    header = (
        f"# Learning-rate search: {grid.title}\n\n"
        f"Scale `{scale}`, grid `{grid.file}`. Written by `{command}` "
        "from the Optuna storage. Objective: final validation Avg PPL (lower is better); grid_avg_ppl is "
        "the sweep's own run at the grid's LR (seed 0), if there is one.\n\n"
    )
    figure = results_dir / "figures" / f"{grid.name}_lr_sensitivity{suffix}.png"
    with Staging(results_dir) as staging:  # all three files or none
        staging.text(md, header + markdown_table(shown) + "\n")
        staging.text(csv, table.to_csv(index=False, float_format="%.6g"))
        staging.figure(figure, lr_figure(grid, studies))
        manifest = stage_manifest(staging, md, command, [md, csv, figure], None)
    return [md, csv, figure, manifest]
