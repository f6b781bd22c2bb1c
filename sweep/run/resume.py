"""Continuing a cell's MLflow run after a crash: which steps the run already holds, a logger that
does not log a replayed step twice, and whether a ``running`` run's process is still alive.

The training state itself is saved and found by ``experiments.checkpointing``; a rerun restarts
``trainer.fit`` from the newest ``step<N>.ckpt``, in the cell's own MLflow run.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from lightning.pytorch.loggers import MLFlowLogger

from experiments.names import Status


def worker_name() -> str:
    """``host:pid``: which process trains a cell (MLflow tag and queue trial attribute ``worker``)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def live_owner(run: Any) -> str | None:
    """The ``worker`` tag of a ``running`` run whose process is alive on this machine, else None.
    (A process on another machine cannot be checked; the queue's heartbeats cover that case.)"""
    owner = run.data.tags.get("worker", "")
    host, _, pid = owner.rpartition(":")
    if run.data.tags.get("status") != Status.RUNNING or host != socket.gethostname() or not pid.isdigit():
        return None
    if int(pid) == os.getpid():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        return owner
    return owner


def logged_steps(client: Any, run_id: str) -> dict[str, int]:
    """For each metric of ``run_id``, the highest step already in the store."""
    run = client.get_run(run_id)
    return {key: max(m.step for m in client.get_metric_history(run_id, key)) for key in run.data.metrics}


class ResumingMLFlowLogger(MLFlowLogger):
    """``MLFlowLogger`` that drops a metric at a step the run already holds.

    A run resumed from step ``k`` replays the steps between ``k`` and where it was killed; their
    points are already stored (the same values on a deterministic run), so each step keeps one
    point per metric.

    Args:
        logged: metric key -> highest step already logged (:func:`logged_steps`).
        **kwargs: as for ``MLFlowLogger``.
    """

    def __init__(self, logged: dict[str, int] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.logged = dict(logged or {})

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if step is not None and self.logged:
            metrics = {k: v for k, v in metrics.items() if step > self.logged.get(k, -1)}
            if not metrics:
                return
        super().log_metrics(metrics, step)
