"""The queue's worker loop: pop a cell, train it with a heartbeat, record the outcome, repeat.

A worker (``python -m sweep.cli worker``, or the sweep's own process when ``WORKERS=1``) prepares
the store and the corpus, then drains the queue (:func:`drain`, :mod:`sweep.run.queue`) of its
grid's cells. Each round it first settles this machine's workers by their processes and fails other
machines' stale trials (their cells go back as WAITING), then pops one cell, trains it with
:func:`~sweep.run.runner.run_cell` under a :class:`~sweep.run.resume.Heartbeat` (a cell that died
resumes from its checkpoint in its own MLflow run) and records the outcome. It leaves when none
of its cells is WAITING or RUNNING, or on a signal (SIGINT, SIGTERM: the cell is saved first).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path

import optuna
from optuna.trial import TrialState

from experiments.names import Outcome
from sweep.grid import Cell, Grid
from sweep.run.placement import job_nodes
from sweep.run.progress import SweepClock
from sweep.run.queue import (
    Queue,
    held_elsewhere,
    older_twin,
    open_queue,
    own_sweep,
    pop_cell,
    record,
    settle_this_machine,
)
from sweep.run.resume import Heartbeat, worker_name
from sweep.run.runner import CellResult, SweepContext, prepare_sweep, run_cell
from sweep.signals import StopRequest

POLL_S = 2.0  # how often an idle worker looks for work or for a dead worker's cell


def run_worker(
    grid: Grid,
    cells: list[Cell],
    results_dir: Path,
    url: str,
    heartbeat_s: int,
    cache_root: Path | None,
    stop: StopRequest,
    out: Callable[[str], None] = print,
    poll_s: float = POLL_S,
) -> list[CellResult]:
    """A worker process (``python -m sweep.cli worker``): prepare, then :func:`drain` the queue.
    Returns the outcomes of the cells this worker took."""
    ctx = prepare_sweep(grid, cells, results_dir, cache_root, stop, out, job_nodes())
    queue = open_queue(cells[0].scale, url, heartbeat_s)
    stop.arm()
    return drain(queue, cells, ctx, heartbeat_s, poll_s)


def drain(
    queue: Queue,
    cells: list[Cell],
    ctx: SweepContext,
    heartbeat_s: int,
    poll_s: float = POLL_S,
    alone: int = 0,
    sweep: str | None = None,
) -> list[CellResult]:
    """Pop and train cells of ``cells`` until the queue has none WAITING or RUNNING that this
    worker may train or wait for, or a signal arrives. Returns the outcomes of the cells this
    worker took.

    It waits for the cells other workers train (one of them may die, and its cell is then taken
    over), except those another sweep's live worker of this machine holds, a stopped process
    included, and later stages waiting on them (:func:`~sweep.run.queue.held_elsewhere`): such a
    worker is never taken over, and this sweep's summary counts them ``busy``. ``sweep``
    (default :func:`~sweep.run.queue.own_sweep`) names this worker's sweep in its claims.

    ``alone`` (the number of cells the sweep queued) makes this the sweep's one worker, in the
    sweep's own process (``WORKERS=1``): its lines number the cells ``[i/n]``."""
    stop, out = ctx.stop, ctx.out
    by_key = {c.run_key: c for c in reversed(cells)}  # the first cell of each config, as enqueued
    parents = {c.run_key: c.parent.run_key for c in cells if c.parent is not None}
    clock = SweepClock(alone or len(by_key))
    me, sweep = worker_name(), sweep or own_sweep()
    outcomes: list[CellResult] = []
    while stop.signum is None:
        settle_this_machine(queue)  # first: a live worker of this machine is never failed
        optuna.storages.fail_stale_trials(queue.study)  # a dead worker's cell goes back as WAITING
        popped, trial = time.monotonic(), pop_cell(queue, set(by_key), parents, sweep)
        if trial is None:
            flying = {t.user_attrs.get("run_key") for t in queue.in_flight()} & set(by_key)
            if not flying - set(held_elsewhere(queue, set(by_key), parents, sweep)):
                break
            time.sleep(poll_s)
            continue
        cell = by_key[trial.user_attrs["run_key"]]
        prefix = f"[{me}] {cell.row.id} s{cell.seed}"
        if alone:
            n = len(str(alone))
            prefix = f"[{len(outcomes) + 1:>{n}}/{alone}] {cell.row.id} s{cell.seed}"
        states = [t.state for t in queue.in_flight() if t.user_attrs.get("run_key") in by_key]
        clock.waiting = states.count(TrialState.WAITING)
        clock.parallel = max(1, states.count(TrialState.RUNNING))
        if stop.signum is not None:  # the signal came while popping: give the cell back
            record(queue, trial, Outcome.NOT_STARTED, "the worker was interrupted")
            break
        twin = older_twin(queue, trial)
        if twin is not None:
            record(queue, trial, Outcome.DUPLICATE, f"trial {twin.number} has this cell")
            continue
        beat = functools.partial(queue.storage.record_heartbeat, queue.trial_id(trial))
        fence = stop if queue.shared else None  # on one machine no live worker is taken over
        with Heartbeat(beat, heartbeat_s, f"{prefix}: trial {trial.number}", fence, out, popped) as heart:
            outcome = run_cell(cell, ctx, prefix, clock, force=bool(trial.user_attrs.get("force")))
        outcomes.append(outcome)
        try:
            if not record(queue, trial, outcome.status, outcome.note, outcome.avg_ppl):
                out(f"{prefix}: trial {trial.number} was taken over after its heartbeat lapsed")
        except Exception as err:  # the queue's database is gone: its trial goes stale, then back
            if not heart.lapsed:
                raise
            out(f"{prefix}: {outcome.status}, not recorded in the queue ({type(err).__name__})")
    return outcomes
