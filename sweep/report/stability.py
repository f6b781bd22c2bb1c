"""The stability ladder report (Table 2's claim at small scale): ``results/<grid>_lr_ladder.{md,csv}``
and ``figures/<grid>_lr_ladder.png``.

Small models reproduce the instabilities of large ones when the learning rate is raised (Wortsman
et al. 2023, "Small-scale proxies for large-scale Transformer training instabilities", arXiv
2309.14322), so each row trains at every rung of a fixed LR ladder (``make stability``) and is
summarised by where it stops training. Definitions, with ``L0 = ln V`` nats (the loss of a uniform
prediction over the vocabulary, which is the loss at initialisation) and ``L(lr)`` the final
validation loss (``val/loss``, nats) of the rung, ``+inf`` for a rung that diverged:

- **LR sensitivity** (Wortsman et al.): the mean over the ladder of
  ``min(L(lr), L0) - min_lr' min(L(lr'), L0)``, nats. A diverged rung counts as ``L0``.
- **Trains**: the rung finished without diverging and its final loss is below ``L0``: it learned
  something. How much worse than the best it ended is what the LR sensitivity measures, so this
  only separates the rungs that learned from those that blew up or ended where they started.
- **Largest LR that trains**: the largest rung that trains (NaN when none does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import optuna
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from experiments.names import TrialOutcome
from sweep.grid import Grid
from sweep.report.display import markdown_table
from sweep.report.manifest import stage_manifest
from sweep.report.publish import Staging
from sweep.studies import trial_table

SENSITIVITY = "lr_sensitivity"  # nats
LARGEST = "largest_lr_that_trains"
BEST_LR, BEST_LOSS, L0 = "best_max_lr", "best_val_loss", "l0"


def initial_loss(vocab_size: int) -> float:
    """``L0 = ln V`` nats: the cross-entropy of a uniform prediction over ``vocab_size`` tokens."""
    return math.log(vocab_size)


def lr_sensitivity(losses: Sequence[float], l0: float) -> float:
    """Wortsman et al.'s LR sensitivity (nats) of one row's ladder.

    Args:
        losses: the final validation loss of each rung (nats), ``inf`` where the rung diverged,
            NaN where it has no result (not run yet, or failed).
        l0: the loss at initialisation, ``ln V`` nats.

    Returns:
        ``mean(min(L, l0)) - min(min(L, l0))`` over the rungs; NaN when a rung has no result (the
        mean is over the whole ladder or nothing).
    """
    clipped = np.minimum(np.asarray(losses, dtype=float), l0)
    if not len(clipped) or np.isnan(clipped).any():
        return math.nan
    return float(np.mean(clipped - clipped.min()))


def trains(losses: Sequence[float], l0: float) -> list[bool]:
    """Whether each rung trains: it finished (a finite final loss, nats; ``inf`` diverged, NaN no
    result) below ``l0``, the loss at initialisation."""
    return [bool(math.isfinite(v) and v < l0) for v in losses]


def largest_lr_that_trains(lrs: Sequence[float], losses: Sequence[float], l0: float) -> float:
    """The largest of ``lrs`` whose rung :func:`trains` (NaN when none does)."""
    ok = [lr for lr, good in zip(lrs, trains(losses, l0), strict=True) if good]
    return max(ok) if ok else math.nan


def rung_losses(study: optuna.Study, ladder: Sequence[float]) -> list[float]:
    """The final validation loss (nats) of each rung of ``ladder`` in ``study``: its complete
    trial's ``val_loss``, ``inf`` when it diverged, NaN when it has neither (a failed or pruned
    trial, or none yet)."""
    found: dict[float, float] = {}
    for t in trial_table(study):
        if t["state"] == TrialOutcome.COMPLETE:
            found[t["max_lr"]] = t["val_loss"]
        elif t["state"] == TrialOutcome.DIVERGED:
            found[t["max_lr"]] = math.inf
    return [found.get(lr, math.nan) for lr in ladder]


def rung_column(lr: float) -> str:
    """The CSV column of one rung's final loss, e.g. ``loss@2e-03``."""
    return f"loss@{lr:.0e}"


def ladder_table(
    grid: Grid, scale: str, studies: dict[str, optuna.Study], ladder: Sequence[float]
) -> pd.DataFrame:
    """One line per row with a study: qk-norm, gate, the final loss at every rung (``inf``
    diverged, NaN missing), the best rung, the largest LR that trains, the LR sensitivity and L0."""
    lines = []
    for row in grid.rows:
        if row.id not in studies:
            continue
        model = grid.resolve(scale, row, 0).model
        l0 = initial_loss(model.vocab_size)
        losses = rung_losses(studies[row.id], ladder)
        finite = [(v, lr) for v, lr in zip(losses, ladder, strict=True) if math.isfinite(v)]
        best_loss, best_lr = min(finite) if finite else (math.nan, math.nan)
        lines.append(
            {
                "row": row.id,
                "label": row.label,
                "qk_norm": model.qk_norm,
                "gate": model.gate.position if model.gate else "none",
                **{rung_column(lr): v for lr, v in zip(ladder, losses, strict=True)},
                BEST_LR: best_lr,
                BEST_LOSS: best_loss,
                LARGEST: largest_lr_that_trains(ladder, losses, l0),
                SENSITIVITY: lr_sensitivity(losses, l0),
                L0: l0,
            }
        )
    return pd.DataFrame(lines)


def verdicts(grid: Grid, table: pd.DataFrame) -> list[str]:
    """For each row compared with another (``compare_to``, else the grid's baseline row): whether
    it widens the stable range, i.e. whether its largest LR that trains is larger than its
    reference's, with both LR sensitivities."""
    by_id = table.set_index("row") if len(table) else table
    out = []
    for row in grid.rows:
        ref = grid.reference(row)
        if ref.id == row.id or row.id not in by_id.index or ref.id not in by_id.index:
            continue
        mine, theirs = by_id.loc[row.id], by_id.loc[ref.id]
        a, b = mine[LARGEST], theirs[LARGEST]
        if math.isnan(a) or math.isnan(b):
            word = "cannot tell (a row trains at no rung)"
        else:
            word = "widens" if a > b else "narrows" if a < b else "keeps"
            word += " the stable range" + (f" (x{a / b:.3g})" if a != b else "")
        out.append(
            f"{row.label} vs {ref.label}: largest LR that trains {_lr(a)} vs {_lr(b)}: {word}; "
            f"LR sensitivity {mine[SENSITIVITY]:.3f} vs {theirs[SENSITIVITY]:.3f} nats"
        )
    return out


def ladder_figure(table: pd.DataFrame, ladder: Sequence[float]) -> Figure:
    """Final validation loss against max LR (log axis), one line per row, clipped at L0; diverged
    rungs as x at L0; L0 as a dashed line."""
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.add_subplot()
    lrs = np.asarray(ladder, dtype=float)
    l0 = float(table[L0].iloc[0]) if len(table) else math.nan
    for _, line in table.iterrows():
        losses = np.array([line[rung_column(lr)] for lr in ladder], dtype=float)
        done = np.isfinite(losses)
        drawn = ax.plot(lrs, np.minimum(losses, line[L0]), marker="o", label=line["label"])[0]
        diverged = np.isinf(losses)
        ax.scatter(
            lrs[diverged], np.full(diverged.sum(), line[L0]), marker="x", color=drawn.get_color(), s=70
        )
        drawn.set_markevery(list(np.flatnonzero(done)))
    ax.axhline(l0, linestyle="--", color="grey", linewidth=1, label=f"L0 = ln V = {l0:.2f}")
    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.2g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set(
        xlabel="max learning rate",
        ylabel="final validation loss (nats)",
        title="Stability ladder (x: diverged)",
    )
    ax.legend(fontsize=8)
    return fig


def _lr(v: float) -> str:
    return "—" if math.isnan(v) else f"{v:.2g}"


def _loss(v: float) -> str:
    return "—" if math.isnan(v) else "diverged" if math.isinf(v) else f"{v:.3f}"


def ladder_markdown(table: pd.DataFrame, ladder: Sequence[float], found: Sequence[str]) -> str:
    """The report's body: one line per row (the loss at each rung, ``diverged`` or ``—`` for none;
    the largest LR that trains; the LR sensitivity), then the :func:`verdicts` lines."""
    shown = pd.DataFrame(
        {
            "row": table["row"],
            "qk-norm": table["qk_norm"].map({True: "yes", False: "no"}),
            "gate": table["gate"],
            **{f"{lr:.2g}": table[rung_column(lr)].map(_loss) for lr in ladder},
            "largest LR that trains": table[LARGEST].map(_lr),
            "LR sensitivity (nats)": table[SENSITIVITY].map(lambda v: "—" if math.isnan(v) else f"{v:.3f}"),
        }
    )
    return markdown_table(shown) + "\n\n" + "".join(f"- {v}\n" for v in found)


def write_ladder_report(
    grid: Grid,
    scale: str,
    studies: dict[str, optuna.Study],
    ladder: Sequence[float],
    results_dir: Path,
    command: str,
) -> tuple[list[Path], str]:
    """Write ``<grid>_lr_ladder[_<scale>].{md,csv}`` and ``figures/<grid>_lr_ladder[_<scale>].png``
    (``_<scale>`` at scales other than ``tiny``), all or nothing.

    Returns:
        The paths written and the Markdown body (:func:`ladder_markdown`).
    """
    table = ladder_table(grid, scale, studies, ladder)
    body = ladder_markdown(table, ladder, verdicts(grid, table))
    suffix = "" if scale == "tiny" else f"_{scale}"
    md, csv = (results_dir / f"{grid.name}_lr_ladder{suffix}.{ext}" for ext in ("md", "csv"))
    l0 = float(table[L0].iloc[0]) if len(table) else math.nan
    header = (
        f"# Stability ladder: {grid.title}\n\n"
        f"Scale `{scale}`, grid `{grid.file}`. Written by `{command}` from the Optuna storage. "
        f"Final validation loss (nats) at each max LR of the ladder; L0 = ln V = {l0:.3f} nats. "
        "A rung *trains* when it finished without diverging below L0. LR sensitivity (Wortsman et "
        "al. 2023): the mean over the ladder of min(L, L0) minus its minimum, a diverged rung "
        "counting L0 (docs/lr-search.md).\n\n"
    )
    figure = results_dir / "figures" / f"{grid.name}_lr_ladder{suffix}.png"
    with Staging(results_dir) as staging:  # all three files or none
        staging.text(md, header + body)
        staging.text(csv, table.to_csv(index=False, float_format="%.6g"))
        staging.figure(figure, ladder_figure(table, ladder))
        manifest = stage_manifest(staging, md, command, [md, csv, figure], None)
    return [md, csv, figure, manifest], body
