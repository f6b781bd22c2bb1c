"""The numeric table (``sweep.report.tables``) as the strings a reader sees: Markdown and LaTeX
cells, the heading and the notes under the table."""

from __future__ import annotations

import math

import pandas as pd

from experiments.names import PROBE_COLUMNS, RowStatus
from sweep.grid import Grid
from sweep.report.tables import BenchColumn, bpb_tasks

#: How the paper's tables head their benchmark columns.
PAPER_BENCH = {"hellaswag": "Hellaswag", "mmlu": "MMLU", "gsm8k": "GSM8k"}

BENCH_NOTE = (
    "Benchmarks: lm-evaluation-harness on each run's final weights (`make eval`), offline tasks of "
    "`sweep/eval/suite.py` (Hellaswag, MMLU, GSM8k, ARC-Easy, PIQA, SciQ, LAMBADA: OLMo's evaluation "
    "data, cloze form), 0-shot unless the grid says otherwise (GSM8k: the gold answer after an "
    "8-shot context, cut to the model's window); mean ± std over the seeds scored; chance is "
    "uniform guessing. "
)


def fmt_params(millions: float) -> str:
    """Three significant digits: 201, 1.57, 0.197, 0.0164 (M)."""
    return "—" if math.isnan(millions) else f"{millions:.3g}"


def fmt(value: float, std: float = math.nan, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    text = f"{value:.{digits}f}"
    return f"{text} ± {std:.{digits}f}" if not math.isnan(std) else text


def _fmt_delta(d: float, lo: float, hi: float) -> str:
    if math.isnan(d):
        return "—"
    return f"{d:+.3f}" + (f" [{lo:+.3f}, {hi:+.3f}]" if not math.isnan(lo) else "")


def _fmt_share(value: float) -> str:
    return "—" if value is None or math.isnan(value) else f"{value:.0%}"


def _excludes_zero(lo: float, hi: float) -> bool:
    return lo > 0 or hi < 0  # False for a NaN interval (fewer than three pairs)


def _resolved(table: pd.DataFrame, share_number: int) -> list[str]:
    """Per row, the rows its Avg PPL is resolved from: its reference (``#1``) and the share row
    (``#5``, G1) where the 95% interval of the paired Δ excludes 0; "—" for neither."""
    number = dict(zip(table["id"], table["row"]))
    out = []
    for line in table.itertuples():
        found = []
        if _excludes_zero(line.delta_ci95_low, line.delta_ci95_high):
            found.append(f"#{number[line.compare_to]}")
        if _excludes_zero(line.delta_vs_share_low, line.delta_vs_share_high):
            found.append(f"#{share_number}")
        out.append(", ".join(found) or "—")
    return out


def display_table(
    table: pd.DataFrame,
    columns: tuple[str, ...] = (),
    bench: list[BenchColumn] | None = None,
    share_of: str | None = None,
) -> pd.DataFrame:
    """Human-readable strings for Markdown and LaTeX: missing cells are "—", never 0; the Δ columns
    of a row measured against itself (its ``compare_to`` column names it) read "reference", and a
    "vs #" column names each row's reference when they differ; ``columns`` names the probe columns
    to show (keys of ``experiments.names.PROBE_COLUMNS``); ``bench`` the benchmark columns
    (``sweep.report.tables.bench_columns``), headed with their chance level; ``share_of`` the row
    id the "Share of #N's gain" column divides by (``Grid.share_of``)."""
    domains = [
        c.removeprefix("ppl_") for c in table.columns if c.startswith("ppl_") and not c.endswith("_std")
    ]
    out = pd.DataFrame({"#": table["row"], "Method": table["label"]})
    out["Added Param (M)"] = [fmt_params(v) for v in table["added_params_m"]]
    if (table["active_params_m"] < table["total_params_m"]).any():  # a MoE grid
        out["Active Param (M)"] = [fmt(v, digits=2) for v in table["active_params_m"]]
    for d in domains:
        out[f"PPL {d}"] = [fmt(v, s) for v, s in zip(table[f"ppl_{d}"], table[f"ppl_{d}_std"])]
    out["Avg PPL"] = [
        RowStatus.DIVERGED if status == RowStatus.DIVERGED else fmt(v, s)
        for v, s, status in zip(table["avg_ppl"], table["avg_ppl_std"], table["status"])
    ]
    out["Δ Avg PPL"] = [
        _fmt_delta(*v) for v in zip(table["delta_avg_ppl"], table["delta_ci95_low"], table["delta_ci95_high"])
    ]
    if share_of is not None and "share_of_gain" in table.columns:
        number = table.loc[table["id"] == share_of, "row"].iloc[0]
        out[f"Share of #{number}'s gain"] = [_fmt_share(v) for v in table["share_of_gain"]]
        if table["delta_ci95_low"].notna().any():  # three seeds or more: what the noise resolves
            versus = zip(table["delta_vs_share"], table["delta_vs_share_low"], table["delta_vs_share_high"])
            out[f"Δ vs #{number}"] = [_fmt_delta(*v) for v in versus]
            out["Resolved from"] = _resolved(table, number)
    out["Seeds"] = table["n_seeds"]
    if "vs_reference_last_half" in table.columns and table["vs_reference_last_half"].astype(bool).any():
        out["vs ref., last half"] = [v or "—" for v in table["vs_reference_last_half"]]
    for column in columns:
        spec = PROBE_COLUMNS[column]
        out[spec.heading] = [fmt(v, s, spec.digits) for v, s in zip(table[column], table[f"{column}_std"])]
        if spec.floor is not None:
            out[f"{spec.heading} floor"] = [fmt(v, digits=spec.digits) for v in table[f"{column}_floor"]]
        if column == "f_attn" and table["delta_f_attn_low"].notna().any():  # three seeds or more
            out["Δ F-Attn"] = [
                _fmt_delta(*v)
                for v in zip(table["delta_f_attn"], table["delta_f_attn_low"], table["delta_f_attn_high"])
            ]
    for b in bench or []:
        key = f"bench_{b.task}"
        cells = [fmt(v, s, 3) for v, s in zip(table[key], table[f"{key}_std"])]
        # a task the sweep leaves to make eval at this scale says so, where a run has no score of it
        unscored = "make eval" if not b.swept else "—"
        out[b.heading] = [
            unscored if c == "—" and has_run else c for c, has_run in zip(cells, table["n_seeds"] > 0)
        ]
    paper_bench = [b for b in bench or [] if b.paper]
    paper_ceval = "paper_ceval" in table.columns and table["paper_ceval"].notna().any()
    if paper_bench:
        hub_ceval = any(b.task.startswith("ceval") for b in bench or [])  # then its own column
        if not hub_ceval and paper_ceval:
            out["C-eval"] = "hub only"  # no offline source of C-eval is known
        out["Bench bpb"] = [fmt(v, s, 3) for v, s in zip(table["bench_bpb"], table["bench_bpb_std"])]
        bpb_delta = zip(table["delta_bench_bpb"], table["delta_bench_bpb_low"], table["delta_bench_bpb_high"])
        out["Δ bench bpb"] = [_fmt_delta(*v) for v in bpb_delta]
    if table["paper_added_params_m"].notna().any():  # Tables 3 and 4 list no parameters
        out["Paper Added (M)"] = [fmt_params(v) for v in table["paper_added_params_m"]]
    notes = table["paper_note"]
    # a grid without a paper table (the sink task) gets no paper columns
    if table["paper_avg_ppl"].notna().any() or notes.astype(bool).any():
        out["Paper Avg PPL"] = [
            "diverged" if note == "diverged" else fmt(v) for v, note in zip(table["paper_avg_ppl"], notes)
        ]
        out["Paper Δ"] = [_fmt_delta(v, math.nan, math.nan) for v in table["paper_delta"]]
    if "paper_share_of_gain" in table.columns:
        out["Paper share"] = [_fmt_share(v) for v in table["paper_share_of_gain"]]
    for b in paper_bench:
        if table[f"paper_{b.paper}"].notna().any():
            # the paper prints percent; ours are fractions
            out[f"Paper {PAPER_BENCH[b.paper]}"] = [fmt(v / 100) for v in table[f"paper_{b.paper}"]]
    if paper_bench and paper_ceval:
        out["Paper C-eval"] = [fmt(v / 100) for v in table["paper_ceval"]]
    for column in columns:
        spec = PROBE_COLUMNS[column]
        if spec.in_paper and table[f"paper_{column}"].notna().any():
            out[f"Paper {spec.heading}"] = [fmt(v, digits=spec.digits) for v in table[f"paper_{column}"]]
    references = table["compare_to"]
    if references.nunique() > 1:
        number = dict(zip(table["id"], table["row"]))
        out.insert(2, "vs #", [number[r] for r in references])
    is_base = table["id"] == references
    out.loc[is_base, "Δ Avg PPL"] = "reference"
    if "Δ bench bpb" in out.columns:
        out.loc[is_base & table["bench_bpb"].notna(), "Δ bench bpb"] = "reference"
    if "Paper Δ" in out.columns:
        out.loc[is_base & table["paper_delta"].notna(), "Paper Δ"] = "reference"
    out["Note"] = [s if s != RowStatus.OK else "" for s in table["status"]]
    if notes.astype(bool).any():
        out["Paper note"] = list(notes)
    return out


def _bench_note(grid: Grid, scale: str, table: pd.DataFrame) -> str:
    if not grid.eval.tasks:
        return ""
    spec = grid.eval.for_scale(scale, sweep=True)
    scored = any(table[c].sum() for c in table.columns if c.startswith("bench_") and c.endswith("_n"))
    if not grid.eval.scored_by_sweep(scale) and not scored:
        return (
            f"Benchmarks: not scored at `{scale}`, where models score at chance; `make sweep` scores "
            f"them at {', '.join(f'`{s}`' for s in grid.eval.scales or ())}, and `make eval GRID={grid.file} "
            f"SCALE={scale}` scores these runs. "
        )
    note = BENCH_NOTE
    if spec.limit is not None:
        note += f"At `{scale}`, the first {spec.limit} documents of each task's fixed shuffle. "
    bpb = bpb_tasks(grid, scale)
    if bpb:
        names = ", ".join(t.removeprefix("offline_") for t in bpb)
        note += (
            "acc_norm: accuracy over log-likelihood per character; bpb: bits per UTF-8 byte of the gold "
            f"continuation (lower is better), which ranks models that answer at chance; Bench bpb: its "
            f"mean over {names}; Δ bench bpb: minus the reference's, paired by seed, with a 95% "
            "t-interval from three seeds on. C-eval has no offline source (hub only). The paper's "
            "Hellaswag, MMLU, GSM8k and C-eval are accuracies (GSM8k's by generation), shown as "
            "fractions. "
        )
    rest = [t for t in grid.eval.tasks if t not in spec.tasks]
    if rest:
        note += (
            f"Not scored by `make sweep` at `{scale}`: {', '.join(rest)}; `make eval GRID={grid.file} "
            f"SCALE={scale}` scores them. "
        )
    return note


def _share_note(grid: Grid, table: pd.DataFrame) -> str:
    if grid.share_of is None:
        return ""
    label = next(r.label for r in grid.rows if r.id == grid.share_of)
    note = (
        f"Share of gain: a row's Δ Avg PPL over the Δ of {label}; the input-independent control's "
        "share is what rescaling the attention branch earns without gating by the input. "
    )
    if table["delta_ci95_low"].notna().any():
        note += (
            f"Δ vs #: Avg PPL minus that of {label}, paired by seed, with its 95% t-interval. "
            "Resolved from: the rows whose difference from this one the seeds resolve (the "
            "interval excludes 0); a row resolved from neither is within seed noise of both. "
        )
    return note


def _curves_note(table: pd.DataFrame) -> str:
    sides = table.get("vs_reference_last_half")
    if sides is None or not sides.astype(bool).any():
        return ""
    return (
        "vs ref., last half: whether the row's mean validation Avg PPL stayed below (better) or "
        "above (worse) its reference's at every validation of the last half of training, or where "
        "it crossed (the curves: `<table>_curves.md`). "
    )


def markdown(
    grid: Grid, scale: str, table: pd.DataFrame, shown: pd.DataFrame, command: str, provenance: str = ""
) -> str:
    """The Markdown file: heading (with ``provenance``, a sentence naming the runs' commit and
    arithmetic: ``sweep.report.manifest.provenance_line``), the table, and notes that say what
    each column means."""
    header = (
        f"# {grid.title}\n\n"
        f"Scale `{scale}`, grid `{grid.file}`, {int(table['n_seeds'].max() or 0)} seed(s) per row at most. "
        f"Written by `{command}` from the MLflow store. {provenance}".rstrip()
        + "\n\n"
    )
    notes = (
        "\n\nPPL: perplexity on held-out validation documents per domain; Avg PPL is their mean. "
        "Δ: Avg PPL minus the baseline's, paired by seed (negative is better); from three seeds on, "
        "a 95% t-interval follows in brackets. Mean ± sample std over seeds. "
        + _share_note(grid, table)
        + _curves_note(table)
        + "".join(PROBE_COLUMNS[c].note for c in grid.columns)
        + (
            "Δ F-Attn: F-Attn minus the reference's, paired by seed, with its 95% t-interval. "
            if "f_attn" in grid.columns and table["delta_f_attn_low"].notna().any()
            else ""
        )
        + _bench_note(grid, scale, table)
        + 'A row whose every run diverged reads "diverged". '
        + (
            f"Paper columns: the paper's own numbers (`sweep/paper/{grid.paper_table}.csv`"
            + "".join(f"; row {r.label!r}: `{r.paper_table}.csv`" for r in grid.rows if r.paper_table)
            + "), for direction, not magnitude. "
            if grid.paper_table
            else ""
        )
        + "— means no finished run (or not applicable), never zero.\n"
    )
    return header + markdown_table(shown) + notes


def markdown_table(shown: pd.DataFrame) -> str:
    """``shown`` as a Markdown table, its values as written (no number parsing), every text cell
    safe inside a row: ``|`` escaped, line breaks as spaces (a label ``"a | b"`` would
    otherwise add a column)."""
    safe = shown.map(lambda v: " ".join(v.replace("|", "\\|").split()) if isinstance(v, str) else v)
    return safe.to_markdown(index=False, disable_numparse=True)
