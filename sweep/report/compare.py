"""``make compare RUNS=a,b``: two runs, or two rows of a grid over their seeds, side by side. Only
the configuration keys that differ are printed, then every summary metric of both with the
difference (paired by seed, with a 95% t-interval from three seeds on), and one figure overlays
their training loss and validation Avg PPL curves."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from experiments import names as N
from experiments.config import to_dict
from sweep.grid import Grid
from sweep.report.display import fmt, markdown_table
from sweep.report.figures import ema
from sweep.report.publish import Staging
from sweep.report.runs import finished_runs, one_arithmetic, runs_frame
from sweep.report.tables import paired_delta
from sweep.store import flatten

#: The FFN width after ``match_params`` (``ModelConfig.effective_ffn_dim``): a param of every
#: dense cell run (``sweep.store.Tracker.start_cell``), computed here for a row.
EFFECTIVE_FFN = "model.ffn_dim_effective"
#: Per-step series and bookkeeping: curves, not results (the figure shows the loss).
_NOT_SUMMARY = ("train/", "moe/", "system/", "epoch", N.SPIKE)  # system/: the machine, not a result


class CompareError(ValueError):
    """A name in ``RUNS`` that is neither a row of the grid nor a run of the store."""


@dataclass
class Side:
    """One side of a comparison: a row (its finished runs, one per seed) or a single run."""

    name: str
    config: dict[str, str]
    """The flattened config (``model.gate.position``: ``sdpa``, ...), the seed left out."""
    runs: pd.DataFrame
    """:func:`sweep.report.runs.runs_frame` lines: ``seed``, ``run_id`` and every metric."""
    note: str = ""
    """Runs left out for their arithmetic (:func:`sweep.report.runs.one_arithmetic`), if any."""


def load_side(name: str, grid: Grid, scale: str, results_dir: Path, client) -> Side:
    """``name`` as a row id of ``grid`` (its finished runs at ``scale``, every seed) or as a run id
    of the store (any experiment).

    Raises:
        CompareError: neither, or a row without a finished run; one line.
    """
    row = next((r for r in grid.rows if r.id == name), None)
    if row is not None:
        runs = finished_runs(grid, scale, results_dir)
        runs = runs[runs["row"] == name]
        if runs.empty:
            raise CompareError(f"RUNS: row '{name}' of {grid.file} has no finished run at scale {scale}")
        resolved = grid.resolve(scale, row, 0)
        config = flatten(to_dict(resolved))
        if resolved.model.moe is None:  # the width match_params leaves, not only the one asked for
            config[EFFECTIVE_FFN] = str(resolved.model.effective_ffn_dim())
    else:
        try:
            run = client.get_run(name)
        except Exception:  # MLflow raises its own types for an unknown id
            raise CompareError(
                f"RUNS: '{name}' is neither a row of {grid.file} nor a run id of the tracking store"
            ) from None
        runs, config = runs_frame([run]), dict(run.data.params)
    config.pop("seed", None)
    runs, left_out = one_arithmetic(runs)
    note = ""
    if not left_out.empty:
        seeds = ", ".join(f"s{seed}" for seed in left_out["seed"])
        kept, other = runs["arithmetic"].iloc[0], left_out["arithmetic"].iloc[0]
        note = f"{name}: left out {seeds}, computed as {other}, not {kept} like the rest"
    return Side(name, config, runs.reset_index(drop=True), note)


def config_diff(a: Side, b: Side) -> pd.DataFrame:
    """The configuration keys whose values differ (or that one side lacks): ``key``, a, b."""
    keys = sorted(k for k in a.config.keys() | b.config.keys() if a.config.get(k) != b.config.get(k))
    return pd.DataFrame(
        {
            "key": keys,
            a.name: [a.config.get(k, "—") for k in keys],
            b.name: [b.config.get(k, "—") for k in keys],
        }
    )


def summary_metrics(side: Side) -> list[str]:
    """The side's result metrics: not per step (``train/``, ``moe/``, ``system/``) and not per layer."""
    return [
        c
        for c in side.runs.columns
        if "/" in c and not c.startswith(_NOT_SUMMARY) and N.LAYER_SEP not in c and side.runs[c].notna().any()
    ]


def metric_diff(a: Side, b: Side) -> pd.DataFrame:
    """Every summary metric both sides have (``val/*`` first): mean ± std over seeds of each, and
    ``b - a``. Where the sides share seeds, both means and the difference are over those seeds
    alone, paired (a 95% t-interval from three pairs); else over every run of each side."""
    lines = []
    keys = sorted(
        set(summary_metrics(a)) & set(summary_metrics(b)), key=lambda k: (not k.startswith("val/"), k)
    )
    for key in keys:
        va, vb = (s.runs.set_index("seed")[key].dropna() for s in (a, b))
        shared = va.index.intersection(vb.index)
        if len(shared):
            va, vb = va.loc[shared], vb.loc[shared]
        d, lo, hi, pairs = paired_delta(vb, va)
        if pairs == 0:
            d = float(vb.mean() - va.mean())
        digits = 0 if key.startswith("params/") else 3
        lines.append(
            {
                "metric": key,
                a.name: fmt(float(va.mean()), _std(va), digits),
                b.name: fmt(float(vb.mean()), _std(vb), digits),
                f"{b.name} − {a.name}": f"{d:+.{digits}f}"
                + (f" [{lo:+.3f}, {hi:+.3f}]" if not math.isnan(lo) else ""),
                "seeds": f"{pairs} paired" if pairs else f"{len(va)} / {len(vb)}, none shared",
            }
        )
    return pd.DataFrame(lines)


def _std(values: pd.Series) -> float:
    return float(values.std()) if len(values) > 1 else math.nan


def compare_figure(a: Side, b: Side, client) -> Figure:
    """Training loss (EMA 0.9, nats) and validation Avg PPL against the step, every run of both
    sides, one colour per side."""
    fig = Figure(figsize=(11, 4), layout="constrained")
    loss_ax, val_ax = fig.subplots(1, 2)
    for side, color in ((a, "tab:gray"), (b, "tab:red")):
        for i, run in enumerate(side.runs.itertuples()):
            label = (
                f"{side.name} ({len(side.runs)} run{'s' if len(side.runs) > 1 else ''})" if i == 0 else None
            )
            older = client.get_run(run.run_id).data.tags.get(N.METRIC_STEPS_TAG) != N.METRIC_STEPS_UPDATES
            for ax, key, smooth in ((loss_ax, N.TRAIN_LOSS, ema), (val_ax, N.VAL_PPL_AVG, np.asarray)):
                points = sorted(client.get_metric_history(run.run_id, key), key=lambda m: m.step)
                shift = 1 if older and key == N.VAL_PPL_AVG else 0  # validations logged one step low
                steps, values = [m.step + shift for m in points], np.array([m.value for m in points])
                ax.plot(
                    steps,
                    smooth(values),
                    color=color,
                    alpha=0.8,
                    lw=1.2,
                    label=label,
                    marker="o" if ax is val_ax else None,
                    ms=3,
                )
    loss_ax.set(xlabel="step", ylabel="training loss (nats, EMA 0.9)", title="Training loss")
    val_ax.set(xlabel="step", ylabel="validation Avg PPL", title="Validation Avg PPL")
    loss_ax.legend(fontsize=8)
    return fig


def write_compare(a: Side, b: Side, client, results_dir: Path) -> tuple[str, Path]:
    """The comparison as Markdown (config keys that differ, then the metrics) and its figure at
    ``results/figures/compare_<a>_<b>.png``; returns both."""
    diff = config_diff(a, b)
    keys = markdown_table(diff) if len(diff) else "(none: the same configuration)"
    metrics = metric_diff(a, b)
    notes = "".join(f"Note: {n}\n\n" for side in (a, b) for n in (side.note, diverged_note(side)) if n)
    text = (
        notes + f"Configuration keys that differ ({len(diff)}):\n\n{keys}\n\n"
        f"Metrics (mean ± std over the seeds both have, paired, else over every run):\n\n"
        f"{markdown_table(metrics) if len(metrics) else '(no metric both have)'}\n"
    )
    path = results_dir / "figures" / f"compare_{_file_part(a.name)}_{_file_part(b.name)}.png"
    with Staging(results_dir) as staging:
        staging.figure(path, compare_figure(a, b, client))
    return text, path


def diverged_note(side: Side) -> str:
    """A line naming the side's runs that diverged (seed and step), whose metrics are those of a
    blown-up model; empty if none did."""
    gone = side.runs[side.runs["status"] == N.Status.DIVERGED] if "status" in side.runs else side.runs[:0]
    if gone.empty:
        return ""
    steps = gone[N.DIVERGED_STEP] if N.DIVERGED_STEP in gone else pd.Series(math.nan, index=gone.index)
    where = ", ".join(
        f"s{seed}" + ("" if math.isnan(step) else f" at step {int(step)}")
        for seed, step in zip(gone["seed"], steps)
    )
    return (
        f"{side.name} diverged ({where}; {len(gone)} of {len(side.runs)} run(s)): "
        "its metrics are those of the diverged model"
    )


def _file_part(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in name)[:40]
