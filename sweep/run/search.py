"""The LR search and the stability ladder as a command runs them: one Optuna study per row
(:func:`sweep.run.tune.tune_row`) under one Ctrl-C / SIGTERM handler, and the failures that make
the command exit 1."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.trial import TrialState

from experiments.corpus import build_corpus
from sweep.grid import Cell, Grid
from sweep.run.corpora import check_fits, check_sources
from sweep.run.tune import tune_row
from sweep.signals import StopRequest
from sweep.studies import trial_outcome


class SearchStopped(Exception):
    """The search stopped on Ctrl-C or SIGTERM; ``code`` is the exit status (130, 143)."""

    def __init__(self, code: int) -> None:
        self.code = code
        super().__init__(code)


def tune_rows(
    grid: Grid,
    scale: str,
    cells: list[Cell],
    trials: int,
    results: Path,
    storage: str | None,
    lr_range: tuple[float, float],
    ladder: list[float] | None,
    cache_root: Path | None,
) -> dict[str, optuna.Study]:
    """Run (or continue) one study per row of ``cells`` (their first seed's), by row id. A first
    Ctrl-C stops the running trial at its next step: it fails cleanly and does not count.

    Raises:
        experiments.corpus.CorpusError, GridError: a source cannot be read here, or the model does
            not fit the corpus (``sweep.run.corpora``).
        ValueError: a row is a later stage (its trial would train from scratch, not from its
            parent's weights), or a study holds trials of another config or ladder.
        SearchStopped: Ctrl-C or SIGTERM.
    """
    rows = [c.row for c in cells if c.seed == cells[0].seed]
    staged = [r.id for r in rows if r.parent is not None]
    if staged:
        raise ValueError(
            f"rows {', '.join(staged)} are later stages (parent:); the LR search trains first stages only"
        )
    for data in {c.config.data for c in cells}:  # one line, exit 2, before any study or run exists
        check_sources(data)
        check_fits(grid, [c for c in cells if c.config.data == data], build_corpus(data, cache_root))
    with StopRequest() as stop:
        stop.arm()
        args = (trials, results, storage, lr_range, ladder, cache_root)
        try:
            return {row.id: tune_row(grid, scale, row, *args, stop=stop) for row in rows}
        except (KeyboardInterrupt, SystemExit):  # SystemExit: Lightning's answer to a second Ctrl-C
            if stop.signum is None:
                raise
            raise SearchStopped(stop.exit_code) from None


def unretried_failures(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """FAIL trials that no later trial retried (the heartbeat's retry names its ``failed_trial``),
    surplus ones (never run) and ones a signal stopped left out."""
    trials = study.get_trials(deepcopy=False)
    retried = {t.system_attrs.get("failed_trial") for t in trials}
    return [
        t
        for t in trials
        if t.state == TrialState.FAIL and t.number not in retried and trial_outcome(t) is not None
    ]


def failed_trials(studies: dict[str, optuna.Study]) -> int:
    """Trials of ``studies`` that failed with no retry to replace them (:func:`unretried_failures`)."""
    return sum(len(unretried_failures(s)) for s in studies.values())
