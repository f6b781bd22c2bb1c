"""A fixed LR ladder as an Optuna study (``make stability``): which rungs still need a trial, and
a queued trial for each, so a rung whose trial failed (a Ctrl-C) trains again on the rerun."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

COUNTED = (TrialState.COMPLETE, TrialState.PRUNED)  # trials that use up the budget


def unvisited(study: optuna.Study, ladder: list[float]) -> list[float]:
    """Rungs of ``ladder`` with no complete or pruned trial yet.

    Raises:
        ValueError: the study already holds trials of another ladder.
    """
    tried = {t.params["max_lr"] for t in study.get_trials(deepcopy=False) if "max_lr" in t.params}
    if tried - set(ladder):
        raise ValueError(f"study {study.study_name} was run with another ladder: {sorted(tried)}")
    done = {t.params["max_lr"] for t in study.get_trials(deepcopy=False, states=COUNTED)}
    return [lr for lr in ladder if lr not in done]


def enqueue_rungs(study: optuna.Study, ladder: list[float]) -> None:
    """Queue a trial for each rung of ``ladder`` that has no complete, pruned, waiting or running
    trial: a rung whose trial failed (a Ctrl-C) is trained again."""
    pending = {
        t.params.get("max_lr", t.system_attrs.get("fixed_params", {}).get("max_lr"))
        for t in study.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING))
    }
    for lr in unvisited(study, ladder):
        if lr not in pending:
            study.enqueue_trial({"max_lr": lr})
