"""Tracking store -> pandas -> the paper's tables (Markdown, CSV, LaTeX), beside the paper's numbers.

Each row of the grid becomes one table row in the grid's order. Several seeds give mean +- std
(sample std); from three paired seeds on, the difference to the baseline gets a 95% t-interval
over the per-seed differences. A row without a finished run shows as missing, never as zero; a
row whose runs all diverged shows "diverged", as the paper's Table 2 shows "-". Beside PPL, the
probes (``experiments.probes``) give the gate score, M-Act and F-Attn columns of Table 4.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
from scipy import stats

from experiments.config import GateConfig, to_dict
from experiments.model import parameter_count, parameter_counts
from sweep.bench_eval import bench_key, shown_metrics
from sweep.grid import Cell, Grid, Row, paper_csv, run_key
from sweep.tracking import (
    DONE_STATUSES,
    STATUS_DIVERGED,
    STATUS_FINISHED,
    Tracker,
    experiment_name,
    flatten,
    tracking_uri,
)

#: Table column -> the MLflow metric it summarises (per run), and its Markdown heading.
PROBE_COLUMNS = {
    "gate_score": ("gate/score_mean", "Gate score", 3),
    "m_act": ("act/max_mean", "M-Act", 1),
    "f_attn": ("sink/first_token_attn", "F-Attn", 3),
    "loss_spikes": ("stability/loss_spikes", "Loss spikes", 1),
}
PAPER_PROBE_COLUMNS = ("gate_score", "m_act", "f_attn")  # what the paper's Table 4 reports


BENCH_NOTE = (
    "Benchmarks: lm-evaluation-harness on each run's final weights (`make eval`), offline tasks of "
    "`sweep/bench_suite.py`, 0-shot unless the grid says otherwise; mean ± std over the seeds "
    "scored; chance is uniform guessing. "
)


def paper_table(name: str | None) -> pd.DataFrame | None:
    """The paper's own numbers (``sweep/paper/<name>.csv``), indexed by paper row, or None."""
    return pd.read_csv(paper_csv(name)).set_index("row") if name else None


COLUMN_NOTES = {
    "gate_score": "Gate score: mean gate score over layers on the fixed probe batch (— without a gate). ",
    "m_act": "M-Act: mean over layers of the largest |activation| of the residual stream. ",
    "f_attn": "F-Attn: attention probability on the first token, mean over layers, heads and queries. ",
    "loss_spikes": "Loss spikes: training losses above the running mean by more than z std. ",
}


def finished_runs(grid: Grid, scale: str, results_dir: Path, seeds: list[int] | None = None) -> pd.DataFrame:
    """One line per current cell with a result: ``row``, ``seed``, ``run_id``, ``status``
    (``finished`` or ``diverged``) and every metric of the run.

    A run counts only when its ``run_key`` is the one the grid gives its row and seed today, so
    runs of an edited grid (or of rows since removed) never mix into the table; of several runs
    of one key the newest wins. ``seeds`` restricts the seeds (default: every seed found).
    """
    tracker = Tracker(
        tracking_uri(results_dir), experiment_name(grid.name, scale), results_dir / "mlartifacts"
    )
    runs = [  # MLflow's filter has no IN for tags
        r
        for status in DONE_STATUSES
        for r in tracker.client.search_runs(
            [tracker.experiment_id], filter_string=f"tags.status = '{status}'", max_results=50000
        )
    ]
    return current_runs(grid, scale, runs, seeds)


def current_runs(grid: Grid, scale: str, runs: list, seeds: list[int] | None = None) -> pd.DataFrame:
    """:func:`runs_frame` of the runs that are the grid's current result: one per (row, seed),
    the newest whose ``run_key`` matches the grid today and whose status is a result."""
    runs = sorted(
        (r for r in runs if r.data.tags.get("status") in DONE_STATUSES),
        key=lambda r: r.info.start_time,
        reverse=True,
    )
    rows = {r.id: r for r in grid.rows}
    current, seen = [], set()
    for r in runs:
        tags = r.data.tags
        row, seed, key = rows.get(tags.get("row")), int(tags.get("seed", -1)), tags.get("run_key")
        if row is None or seed < 0 or (seeds is not None and seed not in seeds) or key in seen:
            continue
        if key != run_key(grid.resolve(scale, row, seed)):
            continue
        seen.add(key)
        current.append(r)
    return runs_frame(current)


FRAME_COLUMNS = ["row", "label", "seed", "run_id", "status", "gate"]


def runs_frame(runs: list) -> pd.DataFrame:
    """MLflow runs (``mlflow.search_runs(..., output_format="list")`` or the client's) as one
    line per run: ``row``, ``label``, ``seed``, ``run_id``, ``status``, ``gate`` (see
    :func:`gate_signature`) and every metric under its MLflow key."""
    records = [
        {
            "row": r.data.tags.get("row"),
            "label": r.data.tags.get("label"),
            "seed": int(r.data.tags.get("seed", -1)),
            "run_id": r.info.run_id,
            "status": r.data.tags.get("status"),
            "gate": gate_signature(r.data.params),
            **r.data.metrics,
        }
        for r in runs
    ]
    return pd.DataFrame.from_records(records, columns=FRAME_COLUMNS if not records else None)


def gate_signature(params: dict[str, str] | GateConfig | None) -> str:
    """A run's gate as one comparable string, from its flattened params (``model.gate.*``) or
    from a :class:`GateConfig`; ``"none"`` for the ungated baseline."""
    if params is None or isinstance(params, GateConfig):
        params = flatten({"model": {"gate": to_dict(params)}})
    gate = {k.removeprefix("model.gate."): v for k, v in params.items() if k.startswith("model.gate.")}
    return ",".join(f"{k}={v}" for k, v in sorted(gate.items())) or "none"


def _mean_std(values: pd.Series) -> tuple[float, float]:
    values = values.dropna()
    if values.empty:
        return math.nan, math.nan
    return float(values.mean()), float(values.std(ddof=1)) if len(values) > 1 else math.nan


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


def _paper_value(paper: pd.DataFrame | None, row: Row, column: str) -> float:
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


def _reference_totals(grid: Grid, scale: str) -> dict[str, int]:
    """Total parameters of every row some row is compared with, by row id."""
    firsts = {grid.reference(r).id: r for r in grid.rows}  # one row measured against each reference
    return {rid: parameter_count(grid.reference_config(scale, row).model) for rid, row in firsts.items()}


def _row_parameters(
    grid: Grid, scale: str, rows: list[str] | None = None
) -> Iterator[tuple[int, Row, Cell, float, float]]:
    """(table row number, row, its seed-0 cell, total and active parameters, NaN if unsupported)
    per grid row."""
    for position, row in enumerate(grid.rows, start=1):
        if rows and row.id not in rows:
            continue
        cell = grid.cells(scale, seeds=[0], rows=[row.id])[0]
        total, active = (math.nan, math.nan) if cell.unsupported else parameter_counts(cell.config.model)
        yield row.paper_row or position, row, cell, total, active


def build_table(grid: Grid, scale: str, runs: pd.DataFrame) -> pd.DataFrame:
    """The numeric table: one line per grid row, our figures beside the paper's.

    ``runs`` is :func:`finished_runs`' frame; diverged runs count in ``n_diverged`` only.
    """
    paper = paper_table(grid.paper_table)
    if "status" not in runs.columns:
        runs = runs.assign(status=STATUS_FINISHED)
    diverged = runs[runs["status"] == STATUS_DIVERGED].groupby("row").size().to_dict()
    runs = runs[runs["status"] == STATUS_FINISHED]
    domains = sorted(
        c.removeprefix("val/ppl/") for c in runs.columns if c.startswith("val/ppl/") and c != "val/ppl/avg"
    )
    reference_total = _reference_totals(grid, scale)
    by_row = {rid: g.set_index("seed") for rid, g in runs.groupby("row")} if len(runs) else {}
    nan2 = (math.nan, math.nan)
    lines = []
    for number, row, cell, total, active in _row_parameters(grid, scale):
        reference = grid.reference(row)
        base_runs = by_row.get(reference.id)
        line: dict[str, object] = {"row": number, "id": row.id, "label": row.label}
        line["compare_to"] = reference.id
        line["added_params_m"] = (total - reference_total[reference.id]) / 1e6
        line["total_params_m"], line["active_params_m"] = total / 1e6, active / 1e6
        mine = by_row.get(row.id)
        for d in domains:
            line[f"ppl_{d}"], line[f"ppl_{d}_std"] = _stat(mine, f"val/ppl/{d}")
        line["avg_ppl"], line["avg_ppl_std"] = _stat(mine, "val/ppl/avg")
        line["n_seeds"] = 0 if mine is None else int(mine["val/ppl/avg"].notna().sum())
        line["n_diverged"] = int(diverged.get(row.id, 0))
        if row.id == reference.id and mine is not None:
            d, lo, hi = 0.0, math.nan, math.nan  # the reference itself: no interval to speak of
        elif mine is not None and base_runs is not None:
            d, lo, hi, _ = paired_delta(mine["val/ppl/avg"], base_runs["val/ppl/avg"])
        else:
            d = lo = hi = math.nan
        line["delta_avg_ppl"], line["delta_ci95_low"], line["delta_ci95_high"] = d, lo, hi
        for column, (metric, _, _) in PROBE_COLUMNS.items():
            line[column], line[f"{column}_std"] = _stat(mine, metric) if mine is not None else nan2
        for task, metric in bench_columns(grid):
            key = f"bench_{task}"
            metric_key = bench_key(task, metric)
            if metric_key not in runs:  # lm-eval's own tasks: the first metric they logged
                logged = [
                    c for c in runs.columns if c.startswith(f"bench/{task}/") and not c.endswith("_stderr")
                ]
                metric_key = logged[0] if logged else metric_key
            line[key], line[f"{key}_std"] = _stat(mine, metric_key) if mine is not None else nan2
            scored = mine is not None and metric_key in mine
            line[f"{key}_n"] = int(mine[metric_key].notna().sum()) if scored else 0
        line["paper_added_params_m"] = _paper_value(paper, row, "added_params_m")
        line["paper_avg_ppl"] = _paper_value(paper, row, "avg_ppl")
        line["paper_delta"] = line["paper_avg_ppl"] - _paper_value(paper, reference, "avg_ppl")
        line["paper_note"] = _paper_note(paper, row)
        for column in PAPER_PROBE_COLUMNS:
            line[f"paper_{column}"] = _paper_value(paper, row, column)
        line["status"] = cell.unsupported or _status(mine is not None, line["n_diverged"])
        lines.append(line)
    return pd.DataFrame(lines)


def bench_columns(grid: Grid) -> list[tuple[str, str]]:
    """(task, metric) of each benchmark column: the grid's ``eval.tasks`` and the metric shown."""
    return shown_metrics(grid.eval)


def _bench_heading(task: str, metric: str, cache_root: Path | None = None) -> str:
    """``mmlu_dev acc (chance 0.250)``; pass@1 has no chance level."""
    from sweep.bench_suite import chance, task_dir

    try:
        level = chance(task_dir(cache_root), task)
    except Exception:  # the suite cannot be built here: the heading goes without it
        level = None
    name = task.removeprefix("offline_")
    return f"{name} {metric}" + (f" (chance {level:.3f})" if level is not None else "")


def _stat(runs: pd.DataFrame | None, metric: str) -> tuple[float, float]:
    """Mean and sample std of ``metric`` over a row's runs (NaN where absent)."""
    if runs is None or metric not in runs.columns:
        return math.nan, math.nan
    return _mean_std(runs[metric])


def _status(finished: bool, n_diverged: int) -> str:
    if n_diverged and not finished:
        return "diverged"
    if n_diverged:
        return f"{n_diverged} seed(s) diverged"
    return "ok" if finished else "not run"


def _fmt_params(millions: float) -> str:
    """Three significant digits: 201, 1.57, 0.197, 0.0164 (M)."""
    return "—" if math.isnan(millions) else f"{millions:.3g}"


def _fmt(value: float, std: float = math.nan, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    text = f"{value:.{digits}f}"
    return f"{text} ± {std:.{digits}f}" if not math.isnan(std) else text


def _fmt_delta(d: float, lo: float, hi: float) -> str:
    if math.isnan(d):
        return "—"
    return f"{d:+.3f}" + (f" [{lo:+.3f}, {hi:+.3f}]" if not math.isnan(lo) else "")


def display_table(
    table: pd.DataFrame,
    columns: tuple[str, ...] = (),
    bench: list[tuple[str, str]] | None = None,
) -> pd.DataFrame:
    """Human-readable strings for Markdown and LaTeX: missing cells are "—", never 0; the Δ columns
    of a row measured against itself (its ``compare_to`` column names it) read "reference", and a
    "vs #" column names each row's reference when they differ; ``columns`` names the probe columns
    to show (keys of :data:`PROBE_COLUMNS`); ``bench`` the benchmark columns
    (:func:`bench_columns`), headed with their chance level."""
    domains = [
        c.removeprefix("ppl_") for c in table.columns if c.startswith("ppl_") and not c.endswith("_std")
    ]
    out = pd.DataFrame({"#": table["row"], "Method": table["label"]})
    out["Added Param (M)"] = [_fmt_params(v) for v in table["added_params_m"]]
    if (table["active_params_m"] < table["total_params_m"]).any():  # a MoE grid
        out["Active Param (M)"] = [_fmt(v, digits=2) for v in table["active_params_m"]]
    for d in domains:
        out[f"PPL {d}"] = [_fmt(v, s) for v, s in zip(table[f"ppl_{d}"], table[f"ppl_{d}_std"])]
    out["Avg PPL"] = [
        "diverged" if status == "diverged" else _fmt(v, s)
        for v, s, status in zip(table["avg_ppl"], table["avg_ppl_std"], table["status"])
    ]
    out["Δ Avg PPL"] = [
        _fmt_delta(*v) for v in zip(table["delta_avg_ppl"], table["delta_ci95_low"], table["delta_ci95_high"])
    ]
    out["Seeds"] = table["n_seeds"]
    for column in columns:
        _, heading, digits = PROBE_COLUMNS[column]
        out[heading] = [_fmt(v, s, digits) for v, s in zip(table[column], table[f"{column}_std"])]
    for task, metric in bench or []:
        key = f"bench_{task}"
        out[_bench_heading(task, metric)] = [_fmt(v, s, 3) for v, s in zip(table[key], table[f"{key}_std"])]
    if table["paper_added_params_m"].notna().any():  # Tables 3 and 4 list no parameters
        out["Paper Added (M)"] = [_fmt_params(v) for v in table["paper_added_params_m"]]
    notes = table["paper_note"]
    out["Paper Avg PPL"] = [
        "diverged" if note == "diverged" else _fmt(v) for v, note in zip(table["paper_avg_ppl"], notes)
    ]
    out["Paper Δ"] = [_fmt_delta(v, math.nan, math.nan) for v in table["paper_delta"]]
    for column in columns:
        _, heading, digits = PROBE_COLUMNS[column]
        if column in PAPER_PROBE_COLUMNS and table[f"paper_{column}"].notna().any():
            out[f"Paper {heading}"] = [_fmt(v, digits=digits) for v in table[f"paper_{column}"]]
    references = table["compare_to"]
    if references.nunique() > 1:
        number = dict(zip(table["id"], table["row"]))
        out.insert(2, "vs #", [number[r] for r in references])
    is_base = table["id"] == references
    out.loc[is_base, "Δ Avg PPL"] = "reference"
    out.loc[is_base & table["paper_delta"].notna(), "Paper Δ"] = "reference"
    out["Note"] = [s if s not in ("ok",) else "" for s in table["status"]]
    if notes.astype(bool).any():
        out["Paper note"] = list(notes)
    return out


def table_paths(grid: Grid, scale: str, results_dir: Path) -> dict[str, Path]:
    """``results/<grid>.{md,csv,tex}`` at the default ``tiny`` scale, ``<grid>_<scale>.*`` otherwise."""
    stem = grid.name if scale == "tiny" else f"{grid.name}_{scale}"
    return {ext: results_dir / f"{stem}.{ext}" for ext in ("md", "csv", "tex")}


def write_tables(
    grid: Grid, scale: str, results_dir: Path, command: str, seeds: list[int] | None = None
) -> dict[str, Path]:
    """Write the table files and the figures (``results/figures/``) from the tracking store,
    each file replaced atomically; both also go to the experiment's ``report`` run as artifacts.

    Returns:
        The written paths by extension (tables) and by name (figures).
    """
    runs = finished_runs(grid, scale, results_dir, seeds)
    table = build_table(grid, scale, runs)
    shown = display_table(table, grid.columns, bench_columns(grid))
    paths = table_paths(grid, scale, results_dir)
    header = (
        f"# {grid.title}\n\n"
        f"Scale `{scale}`, grid `{grid.file}`, {int(table['n_seeds'].max() or 0)} seed(s) per row at most. "
        f"Written by `{command}` from the MLflow store.\n\n"
    )
    notes = (
        "\n\nPPL: perplexity on held-out validation documents per domain; Avg PPL is their mean. "
        "Δ: Avg PPL minus the baseline's, paired by seed (negative is better); from three seeds on, "
        "a 95% t-interval follows in brackets. Mean ± sample std over seeds. "
        + "".join(COLUMN_NOTES[c] for c in grid.columns)
        + (BENCH_NOTE if grid.eval.tasks else "")
        + 'A row whose every run diverged reads "diverged". '
        + (
            f"Paper columns: the paper's own numbers (`sweep/paper/{grid.paper_table}.csv`), "
            "for direction, not magnitude. "
            if grid.paper_table
            else ""
        )
        + "— means no finished run (or not applicable), never zero.\n"
    )
    _write_atomic(paths["md"], header + shown.to_markdown(index=False, disable_numparse=True) + notes)
    _write_atomic(paths["csv"], table.to_csv(index=False, float_format="%.6g"))
    _write_atomic(paths["tex"], shown.to_latex(index=False, escape=True))
    from sweep.figures import write_figures  # matplotlib only when tables are written

    tracker = Tracker(tracking_uri(results_dir), experiment_name(grid.name, scale))
    figures = write_figures(runs, tracker.client, results_dir / "figures", paths["md"].stem)
    report = tracker.report_run()
    tracker.log_files(report, list(paths.values()), "tables")
    tracker.log_files(report, list(figures.values()), "figures")
    return {**paths, **figures}


def params_table(grid: Grid, scale: str, rows: list[str] | None = None) -> pd.DataFrame:
    """Total, active and added parameters of each row (default all), on the meta device, beside
    the paper's added parameters (Table 1's column)."""
    paper = paper_table(grid.paper_table)
    reference_total = _reference_totals(grid, scale)
    lines = [
        {
            "#": number,
            "Method": row.label,
            "Total (M)": _fmt(total / 1e6, digits=2),
            "Active (M)": _fmt(active / 1e6, digits=2),
            "Added (M)": _fmt_params((total - reference_total[grid.reference(row).id]) / 1e6),
            "Paper Added (M)": _fmt_params(_paper_value(paper, row, "added_params_m")),
            "Note": cell.unsupported or "",
        }
        for number, row, cell, total, active in _row_parameters(grid, scale, rows)
    ]
    return pd.DataFrame(lines)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
