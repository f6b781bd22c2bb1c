"""Tracking store -> pandas -> the numbers of the paper's tables, beside the paper's own.

Each row of the grid becomes one table row in the grid's order. Several seeds give mean +- std
(sample std); from three paired seeds on, the difference to the row's reference gets a 95%
t-interval over the per-seed differences. A row without a finished run shows as missing, never as
zero; a row whose runs all diverged shows "diverged", as the paper's Table 2 shows "-". Beside
PPL, the probes (``experiments.probes``) give the gate score, M-Act and F-Attn columns of Table 4,
and the benchmark scores (``sweep.eval``) their columns.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import pandas as pd
from scipy import stats

from experiments import names as N
from experiments.names import PROBE_COLUMNS, RowStatus, Status
from sweep.grid import Grid, Row, table_number
from sweep.gridcheck import paper_csv


@dataclass(frozen=True)
class BenchColumn:
    """One benchmark column: the task, the metric key shown, its chance level (NaN: none), the
    column of the paper's tables it stands beside (``hellaswag``, ``mmlu``, ``gsm8k``; None)."""

    task: str
    metric: str
    chance: float = math.nan
    paper: str | None = None
    swept: bool = True
    """Whether ``make sweep`` scores it at the table's scale (else ``make eval`` does)."""

    @property
    def heading(self) -> str:
        """``mmlu acc (chance 0.250)``; pass@1 and bpb have no chance level."""
        name = f"{self.task.removeprefix('offline_')} {N.bench_metric_name(self.task, self.metric)}"
        return name + (f" (chance {self.chance:.3f})" if not math.isnan(self.chance) else "")


def bench_columns(grid: Grid, scale: str, runs: pd.DataFrame) -> list[BenchColumn]:
    """The grid's ``eval.tasks`` as columns over the finished ``runs``: those ``make sweep``
    scores at ``scale`` and the paper's (Table 1's Hellaswag, MMLU, GSM8k) always, any other once
    a run has scored it. Each shows the score its runs logged (``experiments.names.
    bench_score_key``; before any is, the task's ``BENCH_METRIC`` or ``acc``) with the chance
    level the scoring logged."""
    if "status" in runs.columns:
        runs = runs[runs["status"] == Status.FINISHED]
    swept = grid.eval.for_scale(scale, sweep=True).tasks
    out = []
    for task in grid.eval.tasks:
        paper = N.BENCH_PAPER_COLUMN.get(task)
        if task not in swept and paper is None and not any(c.startswith(N.bench_prefix(task)) for c in runs):
            continue
        metric = N.bench_score_key(task, runs.columns) or N.bench_key(task, N.BENCH_METRIC.get(task, "acc"))
        chance_key = N.bench_chance_key(task)
        chance = float(runs[chance_key].dropna().mean()) if chance_key in runs else math.nan
        out.append(BenchColumn(task, metric, chance, paper, task in swept))
    return out


def bpb_tasks(grid: Grid, scale: str) -> list[str]:
    """The tasks whose mean bits per byte is the "Bench bpb" column at ``scale``: the wheel tasks
    ``make sweep`` scores there (the same set for every run, so the means compare)."""
    return [t for t in grid.eval.for_scale(scale, sweep=True).tasks if t in N.BPB_TASKS]


def mean_bpb(runs: pd.DataFrame, tasks: list[str]) -> pd.Series:
    """Per run, the mean bits per byte over ``tasks``; NaN where a run lacks one of them."""
    keys = [N.bench_key(t, N.BENCH_BPB) for t in tasks]
    if not keys or any(k not in runs.columns for k in keys):
        return pd.Series(math.nan, index=runs.index)
    return runs[keys].mean(axis=1, skipna=False)


#: The runs frame's column of each run's mean bits per byte over :func:`bpb_tasks`.
BENCH_BPB_MEAN = "bench/mean_bpb"


def paper_table(name: str | None) -> pd.DataFrame | None:
    """The paper's own numbers (``sweep/paper/<name>.csv``), indexed by paper row, or None."""
    return pd.read_csv(paper_csv(name)).set_index("row") if name else None


def paired_delta(row: pd.Series, base: pd.Series) -> tuple[float, float, float, int]:
    """Mean of per-seed differences ``row - base`` and its 95% t-interval (NaN below 3 pairs).

    Args:
        row, base: metric values indexed by seed.

    Returns:
        (mean difference, CI low, CI high, number of pairs).
    """
    pairs = pd.concat([row, base], axis=1, join="inner").dropna()
    if pairs.empty:
        return math.nan, math.nan, math.nan, 0
    diff = pairs.iloc[:, 0] - pairs.iloc[:, 1]
    n, mean = len(diff), float(diff.mean())
    if n < 3:
        return mean, math.nan, math.nan, n
    half = float(stats.t.ppf(0.975, n - 1) * diff.std(ddof=1) / math.sqrt(n))
    return mean, mean - half, mean + half, n


def _delta_to_reference(
    mine: pd.DataFrame | None, base: pd.DataFrame | None, metric: str, is_reference: bool
) -> tuple[float, float, float]:
    """``metric``'s mean difference to the reference's runs, paired by seed, and its 95% interval
    (:func:`paired_delta`); NaN for the reference itself, without runs or without the metric."""
    if is_reference or mine is None or base is None or metric not in mine:
        return math.nan, math.nan, math.nan
    d, lo, hi, _ = paired_delta(mine[metric], base[metric])
    return d, lo, hi


def paper_value(paper: pd.DataFrame | None, row: Row, column: str) -> float:
    """The paper's ``column`` for ``row`` (by its ``paper_row``), NaN where it has none."""
    if paper is None or row.paper_row not in paper.index or column not in paper.columns:
        return math.nan
    return float(paper.loc[row.paper_row, column])


def _paper_note(paper: pd.DataFrame | None, row: Row) -> str:
    """The paper table's ``note`` for ``row`` (Table 2: "diverged", "converged badly"), else ""."""
    if paper is None or row.paper_row not in paper.index or "note" not in paper.columns:
        return ""
    note = paper.loc[row.paper_row, "note"]
    return note if isinstance(note, str) else ""


def row_parameters(
    grid: Grid, scale: str, rows: list[str] | None = None
) -> Iterator[tuple[int, Row, int, int, int]]:
    """(table row number, row, total, active and added parameters) per grid row (default all);
    added is against the row's reference (its ``compare_to``, else the baseline row)."""
    for position, row in enumerate(grid.rows, start=1):
        if rows and row.id not in rows:
            continue
        total, active = grid.resolve(scale, row, 0).model.param_counts()
        reference = grid.reference_config(scale, row).model.param_counts()[0]
        yield table_number(row, position), row, total, active, total - reference


def _mean_std(values: pd.Series) -> tuple[float, float]:
    values = values.dropna()
    if values.empty:
        return math.nan, math.nan
    return float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else math.nan


def _stat(runs: pd.DataFrame | None, metric: str) -> tuple[float, float]:
    """Mean and sample std of ``metric`` over a row's runs (NaN where absent)."""
    if runs is None or metric not in runs.columns:
        return math.nan, math.nan
    return _mean_std(runs[metric])


def _status(finished: bool, n_diverged: int) -> str:
    if n_diverged and not finished:
        return RowStatus.DIVERGED
    if n_diverged:
        return RowStatus.some_diverged(n_diverged)
    return RowStatus.OK if finished else RowStatus.NOT_RUN


def build_table(grid: Grid, scale: str, runs: pd.DataFrame) -> pd.DataFrame:
    """The numeric table: one line per grid row, our figures beside the paper's.

    ``runs`` is ``sweep.report.runs.finished_runs``' frame (one line per run: ``row``, ``seed``,
    ``status`` and the metrics); diverged runs count in ``n_diverged`` only. With a ``share_of``
    row (G1 in Table 1) and three seeds of some row, ``delta_vs_share`` (with ``_low`` and
    ``_high``, its 95% interval) is each row's paired Δ Avg PPL to that row (issue 31).
    """
    grid_paper = paper_table(grid.paper_table)
    if "status" not in runs.columns:
        runs = runs.assign(status=Status.FINISHED)
    diverged = runs[runs["status"] == Status.DIVERGED].groupby("row").size().to_dict()
    runs = runs[runs["status"] == Status.FINISHED]
    domains = sorted(d for c in runs.columns if (d := N.domain_of(c)))
    runs = runs.assign(**{BENCH_BPB_MEAN: mean_bpb(runs, bpb_tasks(grid, scale))})
    by_row = {rid: g.set_index("seed") for rid, g in runs.groupby("row")} if len(runs) else {}
    bench = bench_columns(grid, scale, runs)
    lines = []
    for number, row, total, active, added in row_parameters(grid, scale):
        paper = paper_table(row.paper_table) if row.paper_table else grid_paper
        reference = grid.reference(row)
        base_runs, mine = by_row.get(reference.id), by_row.get(row.id)
        line: dict[str, object] = {"row": number, "id": row.id, "label": row.label}
        line["compare_to"] = reference.id
        line["added_params_m"] = added / 1e6
        line["total_params_m"], line["active_params_m"] = total / 1e6, active / 1e6
        for d in domains:
            line[f"ppl_{d}"], line[f"ppl_{d}_std"] = _stat(mine, N.val_ppl(d))
        line["avg_ppl"], line["avg_ppl_std"] = _stat(mine, N.VAL_PPL_AVG)
        line["n_seeds"] = 0 if mine is None else int(mine[N.VAL_PPL_AVG].notna().sum())
        line["n_diverged"] = int(diverged.get(row.id, 0))
        if row.id == reference.id and mine is not None:
            d, lo, hi = 0.0, math.nan, math.nan  # the reference itself: no interval to speak of
        elif mine is not None and base_runs is not None:
            d, lo, hi, _ = paired_delta(mine[N.VAL_PPL_AVG], base_runs[N.VAL_PPL_AVG])
        else:
            d = lo = hi = math.nan
        line["delta_avg_ppl"], line["delta_ci95_low"], line["delta_ci95_high"] = d, lo, hi
        # the sink's change against the reference, paired by seed
        f_attn = _delta_to_reference(mine, base_runs, N.F_ATTN, row.id == reference.id)
        line["delta_f_attn"], line["delta_f_attn_low"], line["delta_f_attn_high"] = f_attn
        for column, spec in PROBE_COLUMNS.items():
            line[column], line[f"{column}_std"] = _stat(mine, spec.metric)
            if spec.floor is not None:
                line[f"{column}_floor"] = _stat(mine, spec.floor)[0]
        for b in bench:
            key = f"bench_{b.task}"
            line[key], line[f"{key}_std"] = _stat(mine, b.metric)
            scored = mine is not None and b.metric in mine
            line[f"{key}_n"] = int(mine[b.metric].notna().sum()) if scored else 0
            if b.paper:
                line[f"paper_{b.paper}"] = paper_value(paper, row, b.paper)
        line["bench_bpb"], line["bench_bpb_std"] = _stat(mine, BENCH_BPB_MEAN)
        bpb = _delta_to_reference(mine, base_runs, BENCH_BPB_MEAN, row.id == reference.id)
        line["delta_bench_bpb"], line["delta_bench_bpb_low"], line["delta_bench_bpb_high"] = bpb
        line["paper_ceval"] = paper_value(paper, row, "ceval")
        line["paper_added_params_m"] = paper_value(paper, row, "added_params_m")
        line["paper_avg_ppl"] = paper_value(paper, row, "avg_ppl")
        line["paper_delta"] = line["paper_avg_ppl"] - paper_value(grid_paper, reference, "avg_ppl")
        line["paper_note"] = _paper_note(paper, row)
        for column, spec in PROBE_COLUMNS.items():
            if spec.in_paper:
                line[f"paper_{column}"] = paper_value(paper, row, column)
        line["status"] = _status(mine is not None, line["n_diverged"])
        lines.append(line)
    table = pd.DataFrame(lines)
    if grid.share_of is not None:
        share = table.set_index("id").loc[grid.share_of]
        # only rows measured against the share row's own reference, and never over a zero gain
        off = (table["id"] == table["compare_to"]) | (table["compare_to"] != share["compare_to"])
        ours = share["delta_avg_ppl"] if share["delta_avg_ppl"] else math.nan
        paper = share["paper_delta"] if share["paper_delta"] else math.nan
        table["share_of_gain"] = (table["delta_avg_ppl"] / ours).mask(off)
        table["paper_share_of_gain"] = (table["paper_delta"] / paper).mask(off)
        if (table["n_seeds"] >= 3).any():  # three seeds: Δ to the share row too, with its interval
            versus = [
                paired_delta(by_row[rid][N.VAL_PPL_AVG], by_row[grid.share_of][N.VAL_PPL_AVG])[:3]
                if rid in by_row and grid.share_of in by_row and rid != grid.share_of and not skip
                else (math.nan,) * 3
                for rid, skip in zip(table["id"], off)
            ]
            table["delta_vs_share"], table["delta_vs_share_low"], table["delta_vs_share_high"] = zip(*versus)
    return table
