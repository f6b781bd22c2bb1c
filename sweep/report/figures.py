"""The paper's Figures 1 (right), 2 (left) and 3, drawn from the tracking store with matplotlib.

Each function takes :func:`sweep.report.runs.runs_frame`'s frame (one line per run) and returns a
``matplotlib.figure.Figure``, or None when the frame lacks the runs the figure compares. Rows are
recognised by their gate (``gate_signature``), not their ids, so any grid with the same variants
draws the same figures. The Figure objects need no pyplot, so this works headless and inline.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from experiments import names as N
from experiments.config import GateConfig
from experiments.names import Status
from sweep.grid import Grid
from sweep.report.curves import curves_figure, mean_curves, metric_curves
from sweep.report.runs import gate_signature

BASELINE = gate_signature(None)
SDPA_ELEMENTWISE = gate_signature(GateConfig(position="sdpa"))
#: Figure 3's three panels: the gates whose score distributions the paper compares.
FIGURE3_GATES = {
    "SDPA elementwise": SDPA_ELEMENTWISE,
    "v elementwise": gate_signature(GateConfig(position="value")),
    "SDPA elementwise head-shared": gate_signature(GateConfig(position="sdpa", sharing="head_shared")),
}
EMA = 0.9  # the paper's smoothing of Figure 1's loss curves
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # no bars in the sweep's log


def ema(values: np.ndarray, alpha: float = EMA) -> np.ndarray:
    """Exponential moving average ``s_t = alpha * s_{t-1} + (1 - alpha) * x_t``, ``s_0 = x_0``."""
    out = np.empty(len(values), dtype=float)
    for i, v in enumerate(values):
        out[i] = v if i == 0 else alpha * out[i - 1] + (1 - alpha) * v
    return out


def _history(client, run_id: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    points = sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)
    return np.array([m.step for m in points]), np.array([m.value for m in points])


def loss_figure(runs: pd.DataFrame, client) -> Figure | None:
    """Figure 1 (right): training loss (EMA 0.9) of the baseline and the SDPA elementwise gate,
    every seed, with each loss spike (``stability/spike``) marked at its raw value."""
    chosen = {"Baseline": BASELINE, "SDPA elementwise gate": SDPA_ELEMENTWISE}
    if not all((runs["gate"] == g).any() for g in chosen.values()):
        return None
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    for (name, gate), color in zip(chosen.items(), ("tab:gray", "tab:red")):
        chosen_runs = list(runs[runs["gate"] == gate].itertuples())
        spikes = [_history(client, run.run_id, N.SPIKE) for run in chosen_runs]
        label = f"{name} ({sum(len(s) for s, _ in spikes)} spike(s), {len(chosen_runs)} seed(s))"
        for i, (run, (s_steps, s_loss)) in enumerate(zip(chosen_runs, spikes)):
            steps, loss = _history(client, run.run_id, N.TRAIN_LOSS)
            ax.plot(steps, ema(loss), color=color, alpha=0.8, lw=1.2, label=label if i == 0 else None)
            ax.scatter(s_steps, s_loss, color=color, marker="x", s=40, zorder=3)
    ax.set(xlabel="step", ylabel=f"training loss (nats, EMA {EMA})", title="Training loss, spikes marked x")
    ax.legend(fontsize=8)
    return fig


def first_token_figure(runs: pd.DataFrame) -> Figure | None:
    """Figure 2 (left): F-Attn per layer for every row (mean over seeds); the baseline in black."""
    layer_cols = N.layer_columns(runs.columns, N.F_ATTN)
    runs = runs[runs["status"] == Status.FINISHED]  # a diverged run's probes are mid-training at best
    if not layer_cols or runs.empty:
        return None
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    for (label, gate), group in runs.groupby(["label", "gate"], sort=False):
        values = group[layer_cols].mean().dropna().to_numpy()  # mean over seeds; depth varies by row
        base = gate == BASELINE
        ax.plot(
            np.arange(len(values)),
            values,
            marker="o",
            color="black" if base else None,
            lw=2.5 if base else 1.2,
            label=f"{label} (mean {np.mean(values):.3f})",
        )
    _floor_line(ax, runs)
    ax.set(xlabel="layer", ylabel="attention on the first token", title="First-token attention per layer")
    ax.set_xticks(np.arange(len(layer_cols)))
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    return fig


def _floor_line(ax, runs: pd.DataFrame) -> None:
    """F-Attn's uniform-attention floor (mean over ``runs``) as a dashed line, where logged."""
    if N.F_ATTN_FLOOR in runs.columns and runs[N.F_ATTN_FLOOR].notna().any():
        floor = float(runs[N.F_ATTN_FLOOR].mean())
        ax.axhline(floor, color="gray", ls="--", lw=1, label=f"uniform-attention floor {floor:.3f}")


def gate_histogram(client, run_ids: list[str]) -> tuple[np.ndarray, np.ndarray] | None:
    """Summed gate-score counts over layers and runs from each run's ``probes/gate_hist.npz``:
    (counts (bins,), edges (bins + 1,)), or None when no run has one."""
    total, edges = None, None
    with tempfile.TemporaryDirectory() as tmp:
        for run_id in run_ids:
            try:
                path = client.download_artifacts(run_id, "probes/gate_hist.npz", tmp)
            except Exception:  # MLflow raises several types for a missing artifact
                continue
            with np.load(path) as data:
                counts, edges = data["counts"].sum(axis=0), data["edges"]
            total = counts if total is None else total + counts
    return None if total is None else (total, edges)


def gate_score_figure(runs: pd.DataFrame, client) -> Figure | None:
    """Figure 3: gate-score distributions (all layers, all seeds) of the SDPA elementwise, value
    elementwise and SDPA head-shared gates present in ``runs``, each with its mean."""
    panels = []
    runs = runs[runs["status"] == Status.FINISHED]
    for name, gate in FIGURE3_GATES.items():
        chosen = runs[runs["gate"] == gate]
        hist = gate_histogram(client, list(chosen["run_id"])) if len(chosen) else None
        if hist is not None:  # the mean line only where the runs logged it (NaN: none drawn)
            mean = chosen[N.GATE_SCORE_MEAN].mean() if N.GATE_SCORE_MEAN in chosen else float("nan")
            panels.append((name, hist, float(mean)))
    if not panels:
        return None
    fig = Figure(figsize=(3.2 * len(panels), 3.2), layout="constrained")
    axes = fig.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, (name, (counts, edges), mean) in zip(axes, panels):
        density = counts / counts.sum()
        ax.stairs(density, edges, fill=True, alpha=0.6)
        if mean == mean:
            ax.axvline(mean, color="black", ls="--", lw=1)
        ax.set(title=f"{name}\nmean {mean:.3f}", xlabel="gate score", xlim=(0, 1))
    axes[0].set_ylabel("share of scores")
    return fig


def draw_figures(runs: pd.DataFrame, client) -> dict[str, Figure | None]:
    """The three figures of a table, by name: loss curves, F-Attn by layer and gate scores; None
    for one that ``runs`` does not support."""
    return {
        "loss_curves": loss_figure(runs, client),
        "first_token_attention": first_token_figure(runs),
        "gate_scores": gate_score_figure(runs, client),
    }


def draw_curve_figures(
    grid: Grid, runs: pd.DataFrame, mean: pd.DataFrame, client
) -> dict[str, Figure | None]:
    """The learning curves (validation Avg PPL, ``mean``: :func:`sweep.report.curves.mean_curves`)
    and, where the runs were probed during training (``train.probe_every``), F-Attn and M-Act
    over training (mean over seeds; F-Attn beside its floor), by name."""
    drawn: dict[str, Figure | None] = {"curves": curves_figure(mean, grid)}
    drawn |= dict.fromkeys(("first_token_attention_over_training", "massive_activation_over_training"))
    if len(runs):
        for name, key, label in (
            ("first_token_attention_over_training", N.F_ATTN, "F-Attn (mean over layers)"),
            ("massive_activation_over_training", N.M_ACT, "M-Act (mean over layers)"),
        ):
            probed = mean_curves(metric_curves(runs, client, key), grid)
            fig = curves_figure(probed, grid, ylabel=label)
            if fig is not None and key == N.F_ATTN:
                _floor_line(fig.axes[0], runs)
            drawn[name] = fig
    return drawn
