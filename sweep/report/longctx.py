"""Table 5 of Qiu et al. (2025): long-context scores by evaluation length, with and without YaRN.

The runs' ``longctx/<task>/<length>[.yarn]`` metrics (``experiments.longctx``) become one block per
task in the paper's layout: a line per evaluated row without YaRN, then the same rows with YaRN,
whose cells carry the change YaRN made in brackets (the paper's "82.90 (-6.0)"). Beside them, the
paper's RULER figures at the same length relative to each model's training context (the paper
trained at 32k: its 8k..128k columns are our 1/4x..4x of the stage-2 context).
"""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd

from experiments import names as N
from sweep.grid import Grid
from sweep.report.display import markdown_table
from sweep.report.tables import paired_delta

#: The order of the task blocks; others (RULER's, per-domain PPL) follow in name order.
TASK_ORDER = ("passkey", "passkey_top1", "ppl_avg", "f_attn", "f_attn_ratio")
#: Tasks where lower is better (their YaRN change reads as a rise).
LOWER_IS_BETTER = ("ppl_",)
#: What each task block measures, for the notes under the table.
TASK_NOTES = {
    "passkey": "passkey retrieval by log-likelihood: the share of distractor keys the true key "
    "out-scores (chance 0.5, perfect 1), mean over needle depths and trials",
    "passkey_top1": "passkey retrieval: the share of trials whose true key scores highest of all "
    "candidates (chance 1 / candidates)",
    "ppl_avg": "perplexity of held-out text at that length, mean of the domains' PPL",
    "f_attn": "F-Attn: mean attention probability on the first token at that length",
    "f_attn_ratio": "F-Attn over the uniform-attention floor H_L / L at that length (1 = no sink)",
}
PAPER_TRAIN_CTX = 32 * 1024  # the paper's continued-training context (Section 4.4)
_PAPER_COL = re.compile(r"^(\d+)k$")


def longctx_scores(runs: pd.DataFrame, grid: Grid) -> pd.DataFrame:
    """One line per (row, seed, task, length, yarn) from the runs' ``longctx/`` metrics.

    Args:
        runs: :func:`sweep.report.runs.finished_runs`' frame (``row``, ``seed``, ``status``, metrics).
        grid: the grid (for the rows' order).
    """
    lines = []
    for r in runs.to_dict("records"):
        if r.get("status", "finished") != "finished":
            continue
        for key, value in r.items():
            parsed = N.parse_longctx_key(key) if isinstance(key, str) else None
            if parsed is not None and value is not None and not pd.isna(value):
                task, length, yarn = parsed
                line = {"row": r["row"], "seed": r["seed"], "task": task, "length": length, "yarn": yarn}
                lines.append({**line, "value": float(value)})
    frame = pd.DataFrame(lines, columns=["row", "seed", "task", "length", "yarn", "value"])
    order = {rid: i for i, rid in enumerate(grid.row_ids())}
    return frame.sort_values(
        ["row", "task", "length", "yarn", "seed"], key=lambda c: c.map(order) if c.name == "row" else c
    )


def tasks_of(scores: pd.DataFrame) -> list[str]:
    """The tasks present, in :data:`TASK_ORDER` first, then by name."""
    found = set(scores["task"])
    return [t for t in TASK_ORDER if t in found] + sorted(found - set(TASK_ORDER))


def paper_figure(paper: pd.DataFrame | None, label: str, yarn: bool, ratio: float) -> float:
    """The paper's Table 5 value for the method ``label`` (``" (YaRN)"`` appended with YaRN) at
    ``ratio`` x its 32k training context; NaN where the paper has none."""
    if paper is None:
        return math.nan
    method = f"{label} (YaRN)" if yarn else label
    column = f"{round(ratio * PAPER_TRAIN_CTX / 1024)}k"
    if method not in paper.index or column not in paper.columns:
        return math.nan
    return float(paper.loc[method, column])


#: The columns of :func:`build_longctx_table`'s frame, in order.
TABLE_COLUMNS = [
    "row", "label", "task", "length", "yarn", "ratio", "mean", "std", "n", "yarn_change", "yarn_change_low",
    "yarn_change_high", "gap", "gap_low", "gap_high", "compare_to", "compare_label", "paper",
]  # fmt: skip


def build_longctx_table(
    grid: Grid, scale: str, scores: pd.DataFrame, paper: pd.DataFrame | None
) -> pd.DataFrame:
    """The numeric Table 5, long form: one line per (row, task, length, yarn) with ``mean``,
    ``std``, ``n``; ``yarn_change`` (with YaRN minus without, paired by seed, with its 95%
    t-interval from three seeds on); ``gap`` (this row's YaRN change minus its ``compare_to``
    row's, paired by seed: positive means this row's score fell less, for PPL that it rose more);
    ``ratio`` (length over the row's training context) and ``paper`` (:func:`paper_figure`)."""
    lines = []
    asked = [_asked(grid, scale, r.row, r.task, r.length) for r in scores.itertuples()]
    scores = scores[np.array(asked, dtype=bool)]  # a mask even when empty (a list [] picks columns)
    by = {k: g.set_index("seed")["value"] for k, g in scores.groupby(["row", "task", "length", "yarn"])}
    for (rid, task, length, yarn), values in by.items():
        row = next(r for r in grid.rows if r.id == rid)
        ctx = grid.cells(scale, seeds=[grid.seeds[0]], rows=[rid])[-1].config.train.seq_len
        line = {"row": rid, "label": row.label, "task": task, "length": length, "yarn": yarn}
        line.update(ratio=length / ctx, mean=values.mean(), std=values.std(ddof=1), n=len(values))
        change = lo = hi = math.nan
        if yarn and (rid, task, length, False) in by:
            change, lo, hi, _ = paired_delta(values, by[(rid, task, length, False)])
        line.update(yarn_change=change, yarn_change_low=lo, yarn_change_high=hi)
        gap = g_lo = g_hi = math.nan
        ref = row.compare_to
        if (
            yarn
            and ref
            and ref != rid
            and all((k, task, length, y) in by for k in (rid, ref) for y in (False, True))
        ):
            mine = by[(rid, task, length, True)] - by[(rid, task, length, False)]
            theirs = by[(ref, task, length, True)] - by[(ref, task, length, False)]
            gap, g_lo, g_hi, _ = paired_delta(mine.dropna(), theirs.dropna())
        ref_label = grid.row(ref).label if ref else ""
        line.update(gap=gap, gap_low=g_lo, gap_high=g_hi, compare_to=ref or "", compare_label=ref_label)
        line["paper"] = (
            paper_figure(paper, row.label, yarn, line["ratio"]) if task in ("passkey",) else math.nan
        )
        lines.append(line)
    return pd.DataFrame(lines, columns=TABLE_COLUMNS)  # the columns even with no scores yet


def _asked(grid: Grid, scale: str, rid: str, task: str, length: int) -> bool:
    """Whether the grid's ``longctx:`` section asks for ``task`` at ``length`` tokens for row
    ``rid``: a length it no longer lists, or a RULER task it dropped, may linger in a run scored
    again after the edit (its newer recipe tag then covers the old score too)."""
    spec = grid.longctx
    if spec is None:
        return True
    if task not in N.LONGCTX_TASKS and not task.startswith("ppl_") and task not in spec.ruler_tasks:
        return False
    base = grid.cells(scale, seeds=[grid.seeds[0]], rows=[rid])[0].config.train.seq_len  # the first stage's
    return length in {m * base for m in spec.lengths}


def _cell(line: pd.Series, digits: int) -> str:
    text = f"{line['mean']:.{digits}f}"
    if line["n"] > 1 and not math.isnan(line["std"]):
        text += f" ± {line['std']:.{digits}f}"
    if line["yarn"] and not math.isnan(line["yarn_change"]):
        text += f" ({line['yarn_change']:+.{digits}f})"
    return text


def task_block(table: pd.DataFrame, task: str) -> pd.DataFrame:
    """One task's lines in the paper's layout: rows without YaRN, then with; a column per length."""
    part = table[table["task"] == task]
    digits = 1 if task.startswith("ppl_") else 3
    lengths = sorted(part["length"].unique())
    lines = []
    for yarn in (False, True):
        for rid in dict.fromkeys(part["row"]):
            mine = part[(part["row"] == rid) & (part["yarn"] == yarn)].set_index("length")
            if mine.empty:
                continue
            label = mine["label"].iloc[0] + (" (YaRN)" if yarn else "")
            line = {"Method": label}
            for length in lengths:
                line[str(length)] = _cell(mine.loc[length], digits) if length in mine.index else "—"
            lines.append(line)
    return pd.DataFrame(lines)


def gap_block(table: pd.DataFrame, task: str) -> pd.DataFrame:
    """The YaRN change of each compared row minus its reference's, by length, with intervals."""
    part = table[(table["task"] == task) & table["yarn"] & table["gap"].notna()]
    lines = []
    for _, mine in part.groupby("row", sort=False):
        line = {"Row vs reference": f"{mine['label'].iloc[0]} vs {mine['compare_label'].iloc[0]}"}
        for r in mine.itertuples():
            ci = "" if math.isnan(r.gap_low) else f" [{r.gap_low:+.3f}, {r.gap_high:+.3f}]"
            line[str(r.length)] = f"{r.gap:+.3f}{ci}"
        lines.append(line)
    return pd.DataFrame(lines)


def paper_block(table: pd.DataFrame) -> pd.DataFrame:
    """The paper's RULER figures at our lengths' ratios to the training context (passkey lines)."""
    part = table[table["task"] == "passkey"]
    part = part[part["row"].isin(part.loc[part["paper"].notna(), "row"])].sort_values(["yarn", "length"])
    lines = []
    for (label, yarn), mine in part.groupby(["label", "yarn"], sort=False):
        line = {"Method (paper, RULER)": label + (" (YaRN)" if yarn else "")}
        line.update(
            {f"{r.ratio:g}x ctx": "—" if math.isnan(r.paper) else f"{r.paper:.2f}" for r in mine.itertuples()}
        )
        lines.append(line)
    return pd.DataFrame(lines)


def longctx_markdown(grid: Grid, scale: str, table: pd.DataFrame, command: str, provenance: str = "") -> str:
    """The Markdown file: per task, the Table 5 layout and the gap between rows, then notes
    (``provenance``: as in ``sweep.report.display.markdown``)."""
    seeds = int(table["n"].max()) if len(table) else 0
    out = [
        f"# {grid.title}\n",
        f"Scale `{scale}`, grid `{grid.file}`, {seeds} seed(s) per row at most. "
        f"Written by `{command}` from the MLflow store. {provenance}Columns: evaluation length in tokens.\n",
    ]
    spec = grid.longctx
    recipe = (
        f"YaRN factor {spec.yarn_factor:g}, lengths {', '.join(map(str, spec.lengths))} times the scale's "
        "context"
        if spec is not None
        else "no `longctx:` section"
    )
    if table.empty:
        out.append(
            f"No run of this grid at scale `{scale}` has long-context scores yet: "
            f"`make sweep GRID={grid.file}` trains and scores them, `make eval` scores finished runs.\n"
        )
    out.append(
        f"Scores count only when made with the grid's `longctx:` section as it is ({recipe}); "
        "after an edit, `make eval` scores the runs again and older scores are left out.\n"
    )
    for task in tasks_of(table.rename(columns={"mean": "value"})):
        out.append(f"## {task}\n\n{TASK_NOTES.get(task, _other_note(task))}.\n")
        out.append(markdown_table(task_block(table, task)) + "\n")
        gaps = gap_block(table, task)
        if not gaps.empty:
            better = "rose less" if task.startswith(LOWER_IS_BETTER) else "fell less"
            out.append(
                f"YaRN change of the row minus its reference's, paired by seed (for this task, a "
                f"{'negative' if task.startswith(LOWER_IS_BETTER) else 'positive'} gap: the row's "
                f"figure {better} under YaRN); 95% t-interval from three seeds on:\n"
            )
            out.append(markdown_table(gaps) + "\n")
    paper = paper_block(table)
    if not paper.empty:
        out.append("## The paper's Table 5 at the same lengths relative to the training context\n")
        out.append(markdown_table(paper) + "\n")
    out.append(
        "Mean ± sample std over seeds; with YaRN, the change YaRN made (paired by seed) in brackets. "
        f"YaRN: Peng et al. 2023, applied at evaluation with factor {spec.yarn_factor if spec else 0:g} "
        "(`longctx.yarn_factor`) over each row's training context (no training with it). The paper's "
        "numbers are RULER accuracy of 1.7B models trained on 3.5T tokens, for direction, not magnitude. "
        "— means not evaluated.\n"
    )
    return "\n".join(out)


def _other_note(task: str) -> str:
    if task.startswith("ppl_"):
        return f"perplexity of the held-out `{task.removeprefix('ppl_')}` text at that length"
    return f"RULER `{task}` (lm-evaluation-harness), accuracy"


def longctx_figure(table: pd.DataFrame):
    """Score, Avg PPL and F-Attn (over its floor) against evaluation length: a line per row,
    solid without YaRN and dashed with; error bars are the std over seeds."""
    from matplotlib.figure import Figure

    panels = [t for t in ("passkey", "ppl_avg", "f_attn_ratio") if t in set(table["task"])]
    if not panels:
        return None
    fig = Figure(figsize=(4.2 * len(panels), 3.6), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    colors = dict(zip(dict.fromkeys(table["row"]), [f"C{i}" for i in range(10)]))
    for ax, task in zip(axes, panels):
        part = table[table["task"] == task]
        for (rid, yarn), mine in part.groupby(["row", "yarn"], sort=False):
            mine = mine.sort_values("length")
            label = mine["label"].iloc[0] + (" + YaRN" if yarn else "")
            style = {"color": colors[rid], "linestyle": "--" if yarn else "-", "marker": "o", "capsize": 2}
            ax.errorbar(mine["length"], mine["mean"], yerr=np.nan_to_num(mine["std"]), label=label, **style)
        ax.set_xscale("log", base=2)
        if task == "ppl_avg":
            ax.set_yscale("log")
        if task == "passkey":
            ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")  # chance
        if task == "f_attn_ratio":
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle=":")  # uniform attention
        ax.set_xlabel("evaluation length (tokens)")
        ax.set_title(
            {"passkey": "passkey (chance 0.5)", "ppl_avg": "Avg PPL", "f_attn_ratio": "F-Attn / floor"}[task]
        )
    axes[0].legend(fontsize=7)
    return fig
