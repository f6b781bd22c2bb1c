"""Optuna RDB storage shared by the LR search and the sweep's work queue, and how a search's
trials read.

SQLite at ``results/optuna.db`` on one machine; a PostgreSQL or MySQL URL for many. Every
storage has a heartbeat: a trial whose process stopped beating for three intervals is failed by
the next worker that looks, and retried (``max_retry`` times) as a new waiting trial.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy import event

from experiments.names import TrialOutcome
from sweep.sqlite_lock import LockTimeout, creation_lock
from sweep.store_urls import TrackingError, sqlite_url

HEARTBEAT_S = 30
DIVERGED_ATTR = "diverged"  # the user attribute (its reason) of an LR-search trial pruned for diverging
VAL_LOSS_ATTR = "val_loss"  # the user attribute of a complete LR-search trial: final val/loss, nats
#: The user attribute of a trial a worker asked for after the other workers had taken the last of
#: the budget: FAIL without training, and neither an outcome nor a failure (:func:`trial_outcome`).
SURPLUS_ATTR = "surplus"
#: The user attribute (its reason) of a trial stopped by Ctrl-C or SIGTERM: FAIL in Optuna, so a
#: rerun trains another in its place, and like a surplus trial neither an outcome nor a failure.
STOPPED_ATTR = "stopped"
#: The study's user attribute that tells it from an earlier study of the same name (deleted, then
#: made anew): its MLflow parent run is the one tagged with it, not the old study's.
STUDY_UID_ATTR = "uid"
ROW_KEY_ATTR = "row_run_key"  # the study's user attribute: run_key of the row's config at the grid's LR


def storage_url(results_dir: Path, url: str | None) -> str:
    """``url`` if given, else SQLite at ``results/optuna.db`` (absolute).

    Raises:
        ValueError: the results folder's path cannot be written into a URL (``sweep.store.sqlite_url``).
    """
    return url or sqlite_url(results_dir / "optuna.db")


def make_storage(url: str, heartbeat_s: int | None = None, max_retry: int = 1) -> optuna.storages.RDBStorage:
    """RDB storage with a heartbeat every ``heartbeat_s`` seconds (default ``HEARTBEAT_S``) and a
    grace period of three; a stale trial is retried ``max_retry`` times.

    On SQLite every transaction starts with ``BEGIN IMMEDIATE``: Python's driver otherwise
    begins one only at the first write, so two processes could both read a trial as WAITING and
    both take it. With the write lock taken first, Optuna's check-and-set is atomic here too, as
    it is on PostgreSQL (``SELECT ... FOR UPDATE``). A new SQLite file gets its schema under an
    inter-process lock (:func:`sweep.sqlite_lock.creation_lock`): Optuna's set-up is not safe to
    race either.

    Raises:
        sweep.sqlite_lock.LockTimeout: another process held the set-up lock for minutes.
        sweep.store_urls.TrackingError: the storage cannot be opened (no driver, no server, not
            a database); one line, the password hidden.
    """
    heartbeat_s = heartbeat_s or HEARTBEAT_S
    sqlite = url.startswith("sqlite")
    engine = {"connect_args": {"timeout": 300, "isolation_level": None}} if sqlite else None
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    try:
        with creation_lock(url):  # RDBStorage creates the tables and stamps the schema version
            storage = optuna.storages.RDBStorage(
                url,
                engine_kwargs=engine,
                heartbeat_interval=heartbeat_s,
                grace_period=3 * heartbeat_s,
                heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                    max_retry=max_retry
                ),
            )
    except LockTimeout:
        raise
    except ModuleNotFoundError as err:  # the URL's driver: psycopg for postgresql+psycopg
        hint = " (make servers-setup installs psycopg)" if "psycopg" in str(err.name) else ""
        raise TrackingError(f"Optuna storage {url}: its driver {err.name} is not installed{hint}") from None
    except Exception as err:  # a server that refuses, a file that is not a database
        detail = (str(err).strip().splitlines() or [""])[0][:300]
        raise TrackingError(f"Optuna storage {url} is not usable: {type(err).__name__}: {detail}") from None
    if sqlite:
        event.listen(storage.engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
    return storage


def trial_outcome(t: FrozenTrial) -> str | None:
    """An LR-search trial as :class:`~experiments.names.TrialOutcome` names it: complete, pruned,
    diverged (PRUNED with a ``diverged`` user attribute: the LR was too large) or fail; None for a
    trial still waiting or running, one beyond the budget that never ran (``SURPLUS_ATTR``) or one
    a signal stopped (``STOPPED_ATTR``)."""
    if t.state in (TrialState.RUNNING, TrialState.WAITING) or {SURPLUS_ATTR, STOPPED_ATTR} & set(
        t.user_attrs
    ):
        return None
    if t.state == TrialState.PRUNED:
        return TrialOutcome.DIVERGED if DIVERGED_ATTR in t.user_attrs else TrialOutcome.PRUNED
    return TrialOutcome.COMPLETE if t.state == TrialState.COMPLETE else TrialOutcome.FAIL


def trial_table(study: optuna.Study) -> list[dict]:
    """One record per ended trial: number, LR, state (:func:`trial_outcome`), Avg PPL and final
    validation loss (nats; NaN unless complete, and for trials recorded before it was kept)."""
    records = []
    for t in study.get_trials(deepcopy=False):
        state = trial_outcome(t)
        if state is None:
            continue
        value = t.value if t.state == TrialState.COMPLETE else math.nan
        records.append(
            {
                "trial": t.number,
                "max_lr": t.params.get("max_lr", math.nan),
                "state": state,
                "avg_ppl": value,
                "val_loss": t.user_attrs.get(VAL_LOSS_ATTR, math.nan)
                if state == TrialOutcome.COMPLETE
                else math.nan,
            }
        )
    return records
