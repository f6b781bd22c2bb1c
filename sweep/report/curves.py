"""Learning curves, not one point: validation Avg PPL at every validation of every run, whether each
row's side of the baseline held over the last half of training, and whether the rows' ranking held
over the last third (``results/<grid>_curves.{md,csv}``, ``figures/<grid>_curves.png``).

A small model's table at one step can measure training *speed* rather than where a variant ends;
a row whose side of the baseline flips late says its Δ is not settled at this budget.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from experiments import names as N
from experiments.names import Status
from sweep.grid import Grid, table_number
from sweep.report.display import markdown_table

STABLE_HALF = 0.5  # the rank-vs-baseline column reads the validations of the last half
STABLE_RANKS = 1 / 3  # the ranking check reads the last third


def metric_curves(runs: pd.DataFrame, client, key: str = N.VAL_PPL_AVG) -> pd.DataFrame:
    """``key``'s history of every finished run: one line per (row, seed, step) with ``value``;
    ``step`` counts the optimiser updates taken at that point. Runs tagged
    ``metric_steps=updates`` log it so; older runs logged an in-fit validation one step lower
    (Lightning's count) and the probes after training at ``train.max_steps``."""
    lines = []
    for run in runs[runs["status"] == Status.FINISHED].itertuples():
        found = client.get_run(run.run_id).data
        older = found.tags.get(N.METRIC_STEPS_TAG) != N.METRIC_STEPS_UPDATES
        last = int(found.params.get("train.max_steps", 0)) or None
        for m in client.get_metric_history(run.run_id, key):
            step = m.step + 1 if older else m.step
            step = step if last is None else min(step, last)
            lines.append({"row": run.row, "seed": run.seed, "step": step, "value": m.value})
    return pd.DataFrame(lines, columns=["row", "seed", "step", "value"])


def mean_curves(curves: pd.DataFrame, grid: Grid) -> pd.DataFrame:
    """Rows (grid order, those with curves) x validation steps: the mean over seeds."""
    if curves.empty:
        return pd.DataFrame()
    wide = curves.groupby(["row", "step"])["value"].mean().unstack("step")
    return wide.reindex([r for r in grid.row_ids() if r in wide.index])


def side_of_reference(mean: pd.DataFrame, grid: Grid, fraction: float = STABLE_HALF) -> dict[str, str]:
    """Per row: ``better`` / ``worse`` when its mean curve stayed below / above its reference's
    at every validation of the last ``fraction`` of training (steps >= (1 - fraction) x the last
    step), ``same`` when the curves are equal, else ``flips at`` the steps where the side
    changed; no entry for a reference row or without both curves."""
    if mean.empty:
        return {}
    last = max(mean.columns)
    steps = [s for s in mean.columns if s >= (1 - fraction) * last]
    out = {}
    for row in grid.rows:
        reference = grid.reference(row).id
        if row.id == reference or row.id not in mean.index or reference not in mean.index:
            continue
        diff = (mean.loc[row.id, steps] - mean.loc[reference, steps]).dropna()
        if diff.empty:
            continue
        signs = np.sign(diff.to_numpy())
        if (signs == 0).all():  # the same config as its reference (one run shown in two rows)
            out[row.id] = "same"
        elif (signs < 0).all():
            out[row.id] = "better"
        elif (signs > 0).all():
            out[row.id] = "worse"
        else:
            flips = [int(s) for s, a, b in zip(diff.index[1:], signs[:-1], signs[1:]) if a != b]
            out[row.id] = "flips at " + ", ".join(map(str, flips)) if flips else "flips"
    return out


def ranking_stable(mean: pd.DataFrame, rows: list[str], fraction: float = STABLE_RANKS) -> bool | None:
    """Whether ``rows`` keep one order (by mean Avg PPL) at every validation of the last
    ``fraction`` of training; None when a row has no curve."""
    if mean.empty or any(r not in mean.index for r in rows):
        return None
    last = max(mean.columns)
    steps = [s for s in mean.columns if s >= (1 - fraction) * last]
    orders = {tuple(mean.loc[list(rows), s].sort_values().index) for s in steps}
    return len(orders) == 1


def curves_markdown(grid: Grid, scale: str, mean: pd.DataFrame, command: str) -> str:
    """The curves as Markdown: Avg PPL per row and validation, the side of the reference over the
    last half, and whether the grid's ``curve_rows`` keep their ranking over the last third."""
    labels = {r.id: r.label for r in grid.rows}
    numbers = {r.id: table_number(r, i) for i, r in enumerate(grid.rows, start=1)}
    sides = side_of_reference(mean, grid)
    shown = pd.DataFrame(
        {
            "#": [numbers[r] for r in mean.index],
            "Method": [labels[r] for r in mean.index],
            **{f"step {s}": [_fmt(v) for v in mean[s]] for s in mean.columns},
            "vs reference, last half": [
                "reference" if grid.reference(row).id == row.id else sides.get(row.id, "—")
                for row in (next(x for x in grid.rows if x.id == r) for r in mean.index)
            ],
        }
    )
    rows = grid.curve_rows or grid.row_ids()
    stable = ranking_stable(mean, rows)
    verdict = "no curves" if stable is None else ("stable" if stable else "NOT stable")
    names = ", ".join(f"#{numbers[r]}" for r in rows)
    return (
        f"# {grid.title}: validation Avg PPL over training\n\n"
        f"Scale `{scale}`, mean over seeds, written by `{command}`.\n\n"
        + markdown_table(shown)
        + f"\n\nRanking of rows {names} over the last third of training: **{verdict}**. "
        '"vs reference, last half": better / worse when the row\'s mean curve stayed below / above '
        "its reference's at every validation of the last half; otherwise the steps where it crossed.\n"
    )


def _fmt(value: float) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:.2f}"


def curves_figure(mean: pd.DataFrame, grid: Grid, ylabel: str = "validation Avg PPL") -> Figure | None:
    """One line per row of ``mean`` against the step (log y); the baseline in black."""
    if mean.empty or len(mean.columns) < 2:
        return None
    labels = {r.id: r.label for r in grid.rows}
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.add_subplot()
    for row, values in mean.iterrows():
        base = row == grid.baseline_row
        ax.plot(values.index, values.to_numpy(), color="black" if base else None, lw=2.5 if base else 1.1,
                marker="o", ms=3, label=labels[row])  # fmt: skip
    ax.set(xlabel="step", ylabel=ylabel, yscale="log" if "PPL" in ylabel else "linear")
    ax.legend(fontsize=6, ncol=2)
    return fig
