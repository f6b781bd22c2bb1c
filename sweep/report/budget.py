"""``make budget``: where each row's Δ stands across the training budget (issue 31).

At the validations nearest 25, 50 and 100 % of training: each row's paired Δ Avg PPL to its
reference (with its 95% t-interval from three seeds on), that Δ as a share of the ``share_of``
row's (G1's) gain, and its paired Δ to that row, beside the paper's Δ and share; then, per row,
whether the Δ is resolved (its interval excludes 0) at each point. A Δ that is resolved early and
not at the end measured training speed, not where the variant ends. The baseline's last stretch
says whether the budget reached the flat part of its curve (:func:`flattened`).

Written to ``results/<stem>_budget.{md,csv}`` (the stem of ``sweep.report.write.table_paths``)
from the curves of the finished runs in the tracking store; all or nothing.
"""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd

from experiments import names as N
from experiments.names import Status
from sweep.grid import Grid
from sweep.report.curves import mean_curves, metric_curves
from sweep.report.display import markdown_table
from sweep.report.manifest import provenance, provenance_line, stage_manifest
from sweep.report.publish import Staging
from sweep.report.runs import finished_runs, one_arithmetic
from sweep.report.tables import build_table
from sweep.report.write import table_paths
from sweep.store import Tracker, experiment_name
from sweep.store_urls import tracking_uri

#: The shares of the budget the table reads (the validation nearest each).
FRACTIONS = (0.25, 0.5, 1.0)
#: "Flattened": the baseline's mean validation Avg PPL fell by less than ``FLAT_DROP`` (a
#: fraction of its value) from the validation nearest ``1 - FLAT_TAIL`` of training to the end.
FLAT_TAIL, FLAT_DROP = 0.10, 0.015
#: The columns of :func:`budget_table`'s frame taken from ``build_table`` at each step.
COLUMNS = [
    "row", "id", "label", "compare_to", "n_seeds", "avg_ppl", "avg_ppl_std", "delta_avg_ppl",
    "delta_ci95_low", "delta_ci95_high", "share_of_gain", "delta_vs_share", "delta_vs_share_low",
    "delta_vs_share_high", "paper_delta", "paper_share_of_gain",
]  # fmt: skip


def fraction_steps(steps: list[int], fractions: tuple[float, ...] = FRACTIONS) -> dict[float, int]:
    """The validation step nearest each fraction of the last step (ties: the earlier one).

    >>> fraction_steps([100, 200, 300, 400], (0.25, 0.5, 1.0))
    {0.25: 100, 0.5: 200, 1.0: 400}
    """
    last = max(steps)
    return {f: min(sorted(steps), key=lambda s: abs(s - f * last)) for f in fractions}


def budget_table(
    grid: Grid, scale: str, curves: pd.DataFrame, fractions: tuple[float, ...] = FRACTIONS
) -> pd.DataFrame:
    """One line per (row with curves, fraction): ``fraction``, ``step`` and the columns of
    :data:`COLUMNS`, computed by ``sweep.report.tables.build_table`` from the validation Avg PPL
    of the row's finished runs at that step (so Δ, intervals and shares are those of the main
    table, at another step; ``n_seeds`` says how many seeds had a point there). Two fractions
    that fall on one validation are read once, at the smaller. ``share_of_gain`` is left out
    (NaN) where the share row's own Δ is not a gain: not negative, or an interval that holds 0.

    Args:
        curves: ``sweep.report.curves.metric_curves``' frame (``row``, ``seed``, ``step``,
            ``value``: validation Avg PPL).

    Raises:
        ValueError: ``curves`` is empty, or its rows train for different numbers of steps (a
            share of the budget would be another step for each; one line naming them).
    """
    if curves.empty:
        raise ValueError("no learning curves: no finished run")
    ends = curves.groupby("row")["step"].max()
    if ends.nunique() > 1:
        lengths = ", ".join(f"{row} {int(step)}" for row, step in ends.items())
        raise ValueError(
            f"the rows train for different numbers of steps ({lengths}): a share of the budget is "
            "another step for each; report rows of one length (ROWS=)"
        )
    points = fraction_steps(sorted(curves["step"].unique()), fractions)
    parts = []
    for step in dict.fromkeys(points.values()):
        fraction = min(f for f, s in points.items() if s == step)
        at = curves[curves["step"] == step]
        runs = pd.DataFrame(
            {"row": at["row"], "seed": at["seed"], "status": Status.FINISHED, N.VAL_PPL_AVG: at["value"]}
        )
        table = build_table(grid, scale, runs).reindex(columns=COLUMNS)
        if grid.share_of in set(table["id"]):
            gain = table.set_index("id").loc[grid.share_of]
            if not (gain["delta_avg_ppl"] < 0 and not gain["delta_ci95_high"] >= 0):
                table["share_of_gain"] = math.nan  # no gain to take a share of at this step
        parts.append(table[table["n_seeds"] > 0].assign(fraction=fraction, step=int(step)))
    return pd.concat(parts, ignore_index=True)[["fraction", "step", *COLUMNS]]


def side(d: float, low: float, high: float) -> str:
    """``better`` / ``worse`` where the 95% interval excludes 0, ``within noise`` where it holds
    0, the sign alone with ``(no interval)`` below three seeds, ``same`` for a Δ of exactly 0
    without an interval (one config shown in two rows), ``—`` without a Δ."""
    if math.isnan(d):
        return "—"
    if math.isnan(low):
        return "same" if d == 0 else ("better" if d < 0 else "worse") + " (no interval)"
    return "better" if high < 0 else "worse" if low > 0 else "within noise"


def across_budget(sides: dict[float, str]) -> str:
    """``better at 25, 50, 100 %``, or by group: ``better at 25 %; within noise at 50, 100 %``."""
    groups: dict[str, list[str]] = {}
    for fraction, word in sides.items():
        groups.setdefault(word, []).append(f"{fraction:.0%}".removesuffix("%"))
    return "; ".join(f"{word} at {', '.join(points)} %" for word, points in groups.items())


def flattened(mean: pd.Series, tail: float = FLAT_TAIL) -> tuple[float, int, int]:
    """How much a mean validation curve fell over its last ``tail`` of training: (the fall as a
    fraction of its value at the validation nearest ``(1 - tail)`` of the last step, that step,
    the last step). The fall is NaN when that validation is the last one (too few to tell), and
    negative when the curve rose."""
    steps = sorted(mean.dropna().index)
    start = fraction_steps(steps, (1 - tail,))[1 - tail]
    fall = math.nan if start == steps[-1] else float(1 - mean[steps[-1]] / mean[start])
    return fall, int(start), int(steps[-1])


def flat_line(baseline: pd.Series) -> str:
    """The sentence on the baseline's last stretch (:func:`flattened`)."""
    fall, start, last = flattened(baseline)
    if math.isnan(fall):
        return (
            f"The baseline has no validation in the last {FLAT_TAIL:.0%} of training before step "
            f"{last}: whether its curve flattened cannot be told (validate more often)."
        )
    verdict = "rising" if fall < 0 else "flattened" if fall < FLAT_DROP else "still falling"
    return (
        f"The baseline's mean validation Avg PPL {'rose' if fall < 0 else 'fell'} {abs(fall):.1%} from "
        f"step {start} to step {last} (the last {(last - start) / last:.0%} of training): **{verdict}** "
        f"by this table's criterion (a fall under {FLAT_DROP:.1%} from the validation nearest "
        f"{1 - FLAT_TAIL:.0%} of training to the end). Under "
        "warmup + cosine decay the learning rate is near its floor there, so a flat end is the "
        "schedule's as much as the model's."
    )


def _delta(d: float, low: float, high: float, base: float) -> str:
    if math.isnan(d):
        return "—"
    interval = f" [{low:+.1f}, {high:+.1f}]" if not math.isnan(low) else ""
    share = f" ({d / base:+.1%})" if not math.isnan(base) else ""
    return f"{d:+.1f}{interval}{share}"


def budget_markdown(
    grid: Grid, scale: str, table: pd.DataFrame, mean: pd.DataFrame, command: str, origin: str
) -> str:
    """The budget table as Markdown: per row and point of the budget its Δ (and share of the
    ``share_of`` row's gain), the paper's Δ and share, and its side of the reference and of the
    share row across the budget; a line on the baseline's last stretch (:func:`flat_line`)."""
    points = list(dict.fromkeys(zip(table["fraction"], table["step"])))
    fractions = [f for f, _ in points]
    share_row = grid.share_of
    share_label = next((r.label for r in grid.rows if r.id == share_row), None)
    lines = []
    for rid, rows in table.groupby("id", sort=False):
        by = rows.set_index("fraction").reindex(fractions)  # a point the row lacks: NaN, shown "—"
        first = rows.iloc[0]
        line = {"#": first["row"], "Method": first["label"], "Seeds": int(rows["n_seeds"].min())}
        reference = first["compare_to"] == rid
        for fraction, step in points:
            r = by.loc[fraction]
            base = table[(table["id"] == first["compare_to"]) & (table["fraction"] == fraction)]["avg_ppl"]
            head = f"{fraction:.0%} (step {step})"
            if reference:
                std = "" if math.isnan(r["avg_ppl_std"]) else f" ± {r['avg_ppl_std']:.1f}"
                line[f"Δ at {head}"] = "—" if math.isnan(r["avg_ppl"]) else f"Avg PPL {r['avg_ppl']:.1f}{std}"
            else:
                low, high = r["delta_ci95_low"], r["delta_ci95_high"]
                base_ppl = float(base.iloc[0]) if len(base) else math.nan
                line[f"Δ at {head}"] = _delta(r["delta_avg_ppl"], low, high, base_ppl)
            if share_row:
                share = r["share_of_gain"]
                line[f"Share at {fraction:.0%}"] = "—" if math.isnan(share) else f"{share:.0%}"
        delta = ["delta_avg_ppl", "delta_ci95_low", "delta_ci95_high"]
        sides = {f: side(*by.loc[f, delta]) for f in fractions}
        line["vs reference"] = "reference" if reference else across_budget(sides)
        if share_row:
            versus = ["delta_vs_share", "delta_vs_share_low", "delta_vs_share_high"]
            against = {f: side(*by.loc[f, versus]) for f in fractions}
            line[f"vs {share_label}"] = "—" if rid == share_row or reference else across_budget(against)
        paper_d, paper_share = first["paper_delta"], first["paper_share_of_gain"]
        line["Paper Δ"] = "—" if math.isnan(paper_d) or reference else f"{paper_d:+.3f}"
        if share_row:
            line["Paper share"] = "—" if math.isnan(paper_share) else f"{paper_share:.0%}"
        lines.append(line)
    shown = pd.DataFrame(lines)
    flat = f"\n\n{flat_line(mean.loc[grid.baseline_row])}" if grid.baseline_row in mean.index else ""
    share_note = (
        f" Share: the row's Δ over {share_label}'s Δ at the same step (— where {share_label} shows no "
        f"resolved gain there); vs {share_label}: the row's Δ to {share_label}, paired by seed, on "
        "the same terms."
        if share_row
        else ""
    )
    return (
        f"# {grid.title}: Δ across the training budget\n\n"
        f"Scale `{scale}`, written by `{command}` from the MLflow store. {origin}\n\n"
        + markdown_table(shown)
        + "\n\nΔ: the row's validation Avg PPL minus its reference's at that step, paired by seed "
        "(negative is better), with its 95% t-interval from three seeds on, and as a share of the "
        "reference's Avg PPL in parentheses. Seeds: the fewest a row had a point for at any step "
        "(finished runs only). vs reference: better / worse where the interval excludes 0, within "
        "noise where it holds 0, the sign alone (no interval) below three seeds."
        + share_note
        + " Paper: the paper's final Δ and share (one run, 400B tokens), for direction, not magnitude."
        + flat
        + "\n"
    )


def write_budget(
    grid: Grid,
    scale: str,
    results_dir: Path,
    command: str,
    seeds: list[int] | None = None,
    rows: list[str] | None = None,
) -> dict[str, Path]:
    """Write ``<stem>_budget.{md,csv}`` and its manifest from the finished runs' curves in the store;
    ``rows``: those rows only, with the reference each is measured against.

    Raises:
        ValueError: no finished run of the grid at ``scale`` (with those seeds and rows) is in the
            store, or the rows train for different numbers of steps (:func:`budget_table`).
    """
    runs, _ = one_arithmetic(finished_runs(grid, scale, results_dir, seeds))
    if rows is not None:
        by_id = {row.id: row for row in grid.rows}
        wanted = set(rows) | {grid.reference(by_id[r]).id for r in rows if r in by_id}
        runs = runs[runs["row"].isin(wanted)]
    tracker = Tracker(tracking_uri(results_dir), experiment_name(grid.name, scale))
    curves = metric_curves(runs, tracker.client) if len(runs) else pd.DataFrame()
    if curves.empty:
        raise ValueError(f"no finished run of {grid.file} at scale {scale}: nothing to report")
    table = budget_table(grid, scale, curves)
    stem = table_paths(grid, scale, results_dir, seeds)["md"].stem
    md, csv = results_dir / f"{stem}_budget.md", results_dir / f"{stem}_budget.csv"
    origin = provenance_line(provenance(runs))
    with Staging(results_dir) as staging:
        staging.text(md, budget_markdown(grid, scale, table, mean_curves(curves, grid), command, origin))
        staging.text(csv, table.to_csv(index=False, float_format="%.6g"))
        manifest = stage_manifest(staging, md, command, [md, csv], runs)
    return {"md": md, "csv": csv, "manifest": manifest}
