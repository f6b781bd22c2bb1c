"""The README's headline figure: each Table 1 row's Δ Avg PPL with its 95 % interval over three
seeds, at ``tiny`` and at ``cpu_long``, beside the paper's Δ (Table 1; the constant gate's from
Table 4).

Drawn from the three-seed tables' CSVs (``results/table1_seeds3.csv``,
``results/table1_cpu_long_seeds3.csv``), not from the store, so it needs no runs: ``make headline``
redraws it from the committed tables, and ``make tables`` redraws it whenever it rewrites one of
them. One panel per source, each on its own PPL axis (the paper's models sit near 6 PPL, ours near
390 and 52): compare the sign and which rows are resolved, not the magnitude. A dot is the mean
paired Δ; a whisker its 95 % t-interval (2 degrees of freedom); colour says whether the interval
lies below 0 (better), above 0 (worse) or across it (within seed noise).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from sweep.report.publish import Staging
from sweep.store import code_commit

#: The panels, left to right: (title, the CSV under the results folder, or None for the paper's Δ).
PANELS = (
    ("tiny: 200 steps, 3 seeds", "table1_seeds3.csv"),
    ("cpu_long: 2,400 steps, 3 seeds", "table1_cpu_long_seeds3.csv"),
    ("paper: 15A2B, 400B tokens", None),
)
FIGURE = Path("figures") / "headline.png"
MANIFEST = "headline.manifest.json"
COMMAND = "python -m sweep.report.headline"
COLOURS = {"better": "tab:blue", "worse": "tab:red", "noise": "tab:gray", "paper": "black"}


def verdict(low: float, high: float) -> str:
    """``better`` when the whole interval is below 0, ``worse`` above 0, else ``noise``."""
    if high < 0:
        return "better"
    if low > 0:
        return "worse"
    return "noise"


def headline_figure(tables: dict[str, pd.DataFrame]) -> Figure | None:
    """The figure from the three-seed tables by CSV name (:data:`PANELS`); None without the
    ``tiny`` table, whose rows set the figure's rows (the baseline left out: Δ is against it)."""
    first = tables.get(PANELS[0][1])
    if first is None or first.empty:
        return None
    rows = first[first["id"] != "baseline"].reset_index(drop=True)
    y = np.arange(len(rows))[::-1]
    fig = Figure(figsize=(11, 0.32 * len(rows) + 1.6), layout="constrained")
    axes = fig.subplots(1, len(PANELS), sharey=True)
    for ax, (title, csv) in zip(axes, PANELS):
        ax.axvline(0, color="0.6", linewidth=0.8)
        table = first if csv is None else tables.get(csv)
        base = None if table is None else table[table["id"] == "baseline"]
        if csv is None:
            ax.scatter(rows["paper_delta"], y, color=COLOURS["paper"], s=18, zorder=3)
            baseline = base["paper_avg_ppl"].iloc[0] if len(base) else float("nan")
        else:
            baseline = base["avg_ppl"].iloc[0] if base is not None and len(base) else float("nan")
            _intervals(ax, rows, y, table)
        ax.set_title(f"{title}\nbaseline Avg PPL {baseline:.4g}", fontsize=9)
        ax.set_xlabel("Δ Avg PPL (negative is better)", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(axis="x", color="0.9")
    axes[0].set_yticks(y, [f"#{r.row} {r.label}" for r in rows.itertuples()])
    handles = [
        axes[0].scatter([], [], color=COLOURS[k], label=text)
        for k, text in (
            ("better", "95 % interval below 0"),
            ("worse", "95 % interval above 0"),
            ("noise", "within seed noise"),
            ("paper", "the paper (one run, no interval)"),
        )
    ]
    fig.legend(handles=handles, loc="outside lower center", ncols=4, fontsize=8, frameon=False)
    return fig


def _intervals(ax, rows: pd.DataFrame, y: np.ndarray, table: pd.DataFrame | None) -> None:
    """Dots and whiskers of one table's rows, matched to the figure's rows by id; a row the table
    lacks (or did not run) is left blank."""
    if table is None:
        ax.text(0.5, 0.5, "no table", transform=ax.transAxes, ha="center", color="0.5")
        return
    by_id = table.set_index("id")
    for pos, row_id in zip(y, rows["id"]):
        if row_id not in by_id.index or pd.isna(by_id.at[row_id, "delta_avg_ppl"]):
            ax.text(
                0.02, pos, "not run", transform=ax.get_yaxis_transform(), va="center", fontsize=7, color="0.6"
            )
            continue
        mean, low, high = (
            by_id.at[row_id, k] for k in ("delta_avg_ppl", "delta_ci95_low", "delta_ci95_high")
        )
        colour = COLOURS[verdict(low, high)]
        ax.errorbar(mean, pos, xerr=[[mean - low], [high - mean]], fmt="o", color=colour, ms=4, capsize=2)


def write_headline(results_dir: Path) -> Path | None:
    """Draw :data:`FIGURE` and its manifest under ``results_dir`` from the tables there, all or
    nothing (:class:`~sweep.report.publish.Staging`); None (nothing written) without the
    ``tiny`` three-seed table."""
    tables = {
        csv: pd.read_csv(results_dir / csv) for _, csv in PANELS if csv and (results_dir / csv).is_file()
    }
    fig = headline_figure(tables)
    if fig is None:
        return None
    record = {
        "command": COMMAND,
        "written_by_commit": code_commit() or "unrecorded",
        "files": [str(FIGURE)],
        "inputs": sorted(tables),
    }
    with Staging(results_dir) as staging:
        path = staging.figure(results_dir / FIGURE, fig)
        staging.text(results_dir / MANIFEST, json.dumps(record, indent=1) + "\n")
    return path


def redraw_if_input(results_dir: Path, written: Path) -> None:
    """After ``make tables`` wrote ``written`` (a table's CSV): redraw the headline figure when
    that table is one of its panels. A failure costs the figure, never the tables: one warning."""
    if written.name not in {csv for _, csv in PANELS if csv}:
        return
    try:
        path = write_headline(results_dir)
    except Exception as err:  # the report never crashes after the tables are written
        print(f"warning: headline figure not drawn: {type(err).__name__}: {err}", file=sys.stderr)
        return
    if path is not None:
        print(f"headline figure: {path}")


def main(argv: list[str] | None = None) -> int:
    """``make headline``: redraw the figure from the tables under ``results/``; it takes no option
    (``--help`` says so, anything else is one line, exit 2)."""
    from sweep.cli_parser import OneLineParser

    parser = OneLineParser(prog="python -m sweep.report.headline", description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    path = write_headline(Path("results"))
    if path is None:
        print(f"error: results/{PANELS[0][1]} is missing: make sweep SEEDS=3 writes it", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
