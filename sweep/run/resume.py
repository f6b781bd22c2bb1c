"""Continuing a cell's MLflow run after a crash: which steps the run already holds, a logger that
does not log a replayed step twice, and whether a worker process of this machine is still alive.
Whether a cell is being trained is the work queue's to say (``sweep.run.queue``): it hands each
cell to one worker and knows which are alive by their heartbeats.

The training state itself is saved and found by ``experiments.checkpointing``; a rerun restarts
``trainer.fit`` from the newest ``step<N>.ckpt``, in the cell's own MLflow run.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import psutil
from lightning.pytorch.loggers import MLFlowLogger

from sweep.signals import StopRequest

#: The run tag that names the process training the run, or that trained it last: ``host:pid``
#: (provenance; whether it is alive is the queue's to say).
WORKER_TAG = "worker"
#: Intervals without a recorded heartbeat before a worker stops its cell (:class:`Heartbeat`'s
#: fence): one before the three after which another machine takes the cell over.
LAPSE_BEATS = 2


def worker_name() -> str:
    """``host:pid``: which process trains a cell (MLflow tag and queue trial attribute ``worker``)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def process_start(pid: int) -> float | None:
    """When process ``pid`` of this machine started (unix seconds), or None if there is none.
    A process whose start time cannot be read (another user's, say) counts as started at 0."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None
    except psutil.Error:
        return 0.0


def alive_here(pid: int, recorded_start: str | None) -> bool:
    """Whether process ``pid`` of this machine is still the one that started at
    ``recorded_start`` (an :func:`own_start` value; unknown: any process of that pid counts)."""
    started = process_start(pid)
    if started is None:
        return False
    return not (recorded_start and started and abs(started - float(recorded_start)) > 1.0)


def own_start() -> str:
    """This process's start time, unix seconds (a queue claim's ``started``): it tells this
    process apart from a later one given the same pid."""
    return f"{process_start(os.getpid()):.2f}"


class Heartbeat:
    """Calls ``beat`` at once and every ``interval`` seconds after, in a thread, while entered: a
    queue worker renews its trial's heartbeat this way. A beat that fails warns, and the next one
    tries again (a dropped connection must not end it); one that hangs is not stacked on.

    The fence: once :data:`LAPSE_BEATS` intervals have passed since the start of the last beat
    that succeeded (or since ``since``, the claim's own first beat), because the queue's database
    is unreachable or its calls hang, ``stop`` gets SIGTERM, as from ``kill``: the cell stops at
    its next step's start, saved, and the worker leaves. Other machines take a trial over once its
    heartbeat is three intervals old (``sweep.studies.make_storage``): a cell whose next step
    starts within that last interval (30 s by default) is saved and stopped before anyone resumes
    it. What runs longer is not cut short: a validation, the probes, the final ones of a cell past
    its last step.

    Args:
        beat: records one heartbeat.
        interval: seconds between beats.
        what: names the heartbeat in the lines said (``[host:pid] baseline s0: trial 3``).
        stop: the worker's stop request, fenced as above (None: no fence).
        out: where the fence's line goes.
        since: ``time.monotonic()`` when the trial's first heartbeat was recorded (default: on
            entering).
    """

    def __init__(
        self,
        beat: Callable[[], object],
        interval: float,
        what: str,
        stop: StopRequest | None = None,
        out: Callable[[str], None] = print,
        since: float | None = None,
    ) -> None:
        self.beat, self.interval, self.what, self.stop, self.out = beat, interval, what, stop, out
        self.lapsed = False  # the fence stopped the cell
        self._since = since
        self._last_ok = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _beat(self) -> None:
        started = time.monotonic()  # the store dates the beat about then, however long it took
        try:
            self.beat()
            self._last_ok = max(self._last_ok, started)
        except Exception as err:
            warnings.warn(f"heartbeat of {self.what} failed, retrying: {err}", stacklevel=1)

    def _watch(self) -> None:
        beating, due = None, 0.0
        while True:
            now = time.monotonic()
            silent = now - self._last_ok  # before this round's beat: ``since`` may be long past
            if self.stop is not None and not self.lapsed and silent > LAPSE_BEATS * self.interval:
                self.lapsed = True
                self.out(
                    f"{self.what}: no heartbeat recorded for {silent:.0f} s (the queue's database "
                    "does not answer): stopping the cell saved, before another worker takes it over"
                )
                self.stop.signum = self.stop.signum or signal.SIGTERM
            if now >= due and (beating is None or not beating.is_alive()):
                beating = threading.Thread(target=self._beat, daemon=True)
                beating.start()
                due = now + self.interval
            if self._done.wait(min(self.interval / 4, 1.0)):
                return

    def __enter__(self) -> Heartbeat:
        self._last_ok = time.monotonic() if self._since is None else self._since
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def logged_steps(client: Any, run_id: str) -> dict[str, int]:
    """For each metric of ``run_id``, the highest step already in the store."""
    run = client.get_run(run_id)
    return {key: max(m.step for m in client.get_metric_history(run_id, key)) for key in run.data.metrics}


class ResumingMLFlowLogger(MLFlowLogger):
    """``MLFlowLogger`` that writes its points in batches and never writes a step twice.

    - **Batched.** Points are held and written in one ``log_batch`` every ``flush_every`` steps
      (one store transaction instead of one per step), and whenever :meth:`flush` is called:
      before each checkpoint is saved (:class:`FlushBeforeCheckpoint`), when Lightning finalises
      the logger (the end of ``fit``, an exception) and when the cell ends. A process killed
      between two flushes loses at most the points after its last checkpoint, and the resumed run
      trains those steps again and logs them.
    - **Resumed.** A run resumed from step ``k`` replays the steps between ``k`` and where it was
      killed; points already stored (the same values on a deterministic run) are dropped, so
      each step keeps one point per metric.

    Args:
        logged: metric key -> highest step already logged (:func:`logged_steps`).
        flush_every: steps held before a write.
        **kwargs: as for ``MLFlowLogger``.
    """

    def __init__(self, logged: dict[str, int] | None = None, flush_every: int = 50, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.logged = dict(logged or {})
        self.flush_every = flush_every
        self._pending: list[Any] = []
        self._pending_steps: set[int] = set()

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        step = step or 0
        if self.logged:
            metrics = {k: v for k, v in metrics.items() if step > self.logged.get(k, -1)}
        now = int(time.time() * 1000)
        self._pending += [
            Metric(k, float(v), now, step) for k, v in metrics.items() if not isinstance(v, str)
        ]
        self._pending_steps.add(step)
        if len(self._pending_steps) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Write every held point (in batches of MLflow's 1,000-metric limit)."""
        for i in range(0, len(self._pending), 1000):
            self.experiment.log_batch(self.run_id, metrics=self._pending[i : i + 1000])
        self._pending, self._pending_steps = [], set()

    def finalize(self, status: str = "success") -> None:
        self.flush()
        super().finalize(status)


class FlushBeforeCheckpoint(pl.Callback):
    """Writes the logger's held points before a training-state checkpoint is saved, so the store
    holds every step before the one a resumed run starts from."""

    def __init__(self, logger: ResumingMLFlowLogger) -> None:
        self.logger = logger

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict
    ) -> None:
        if hasattr(pl_module, "check_now"):  # the queued checks first: their spikes join the flush
            pl_module.check_now()
        self.logger.flush()
