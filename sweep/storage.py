"""Optuna RDB storage shared by the LR search and the sweep's work queue.

SQLite at ``results/optuna.db`` on one machine; a PostgreSQL or MySQL URL for many. Every
storage has a heartbeat: a trial whose process stopped beating for three intervals is failed by
the next worker that looks, and retried (``max_retry`` times) as a new waiting trial.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import optuna
from sqlalchemy import event

HEARTBEAT_S = 30


def storage_url(results_dir: Path, url: str | None) -> str:
    """``url`` if given, else SQLite at ``results/optuna.db`` (absolute)."""
    return url or f"sqlite:///{(results_dir / 'optuna.db').resolve()}"


def make_storage(url: str, heartbeat_s: int | None = None, max_retry: int = 1) -> optuna.storages.RDBStorage:
    """RDB storage with a heartbeat every ``heartbeat_s`` seconds (default ``HEARTBEAT_S``) and a
    grace period of three; a stale trial is retried ``max_retry`` times.

    On SQLite every transaction starts with ``BEGIN IMMEDIATE``: Python's driver otherwise
    begins one only at the first write, so two processes could both read a trial as WAITING and
    both take it. With the write lock taken first, Optuna's check-and-set is atomic here too, as
    it is on PostgreSQL (``SELECT ... FOR UPDATE``).
    """
    heartbeat_s = heartbeat_s or HEARTBEAT_S
    sqlite = url.startswith("sqlite")
    engine = {"connect_args": {"timeout": 300, "isolation_level": None}} if sqlite else None
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    storage = optuna.storages.RDBStorage(
        url,
        engine_kwargs=engine,
        heartbeat_interval=heartbeat_s,
        grace_period=3 * heartbeat_s,
        heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=max_retry),
    )
    if sqlite:
        event.listen(storage.engine, "begin", lambda conn: conn.exec_driver_sql("BEGIN IMMEDIATE"))
    return storage
