"""The work queue's protocol: every sweep's cells in one Optuna study, each handed to one worker.

The queue is the one liveness rule: a cell is alive while its worker is (a process of this
machine while it exists, another machine's while its heartbeat is fresh). Its protocol, on
Optuna's RDB storage (``STORAGE``; SQLite, PostgreSQL or MySQL):

1. **Enqueue** (:func:`enqueue_cells`, the driver). Each cell without a result (every cell with
   ``--force``) and no WAITING or RUNNING trial already becomes a WAITING trial of the study
   ``cells-<scale>`` (:func:`queue_name`: one queue for every grid of a scale, so a cell two
   grids share is trained once). The trial's user attributes name the cell (``run_key``,
   ``row``, ``seed``, ``force``).
2. **Pop** (:func:`pop_cell`, a worker). Optuna's check-and-set,
   ``set_trial_state_values(RUNNING)``, succeeds for exactly one process; the winner records a
   first heartbeat and its claim (:data:`CLAIM_ATTR`: trial, ``host:pid``, process start, and
   the sweep it works for, :func:`sweep_of`). A later stage waits while its parent's trial is in
   flight.
3. **Defer to an older twin** (:func:`older_twin`). Two drivers that enqueued one cell at the
   same moment made two trials; the younger one is recorded ``duplicate`` and the older one
   trains the cell.
4. **Beat.** While it trains, the worker renews the trial's heartbeat every interval
   (:class:`~sweep.run.resume.Heartbeat`). On a queue other machines reach, a worker whose
   beats go unrecorded for two intervals stops its cell, saved, and leaves (the fence).
5. **Record** (:func:`record`). The outcome (and Avg PPL, as the trial's value) ends the trial:
   COMPLETE for a result, FAIL otherwise. A killed or not-started cell is enqueued again at once.
6. **Take over a dead worker's cell.** Another machine's worker is dead once its heartbeat is
   three intervals old: the next worker that looks fails the trial (``fail_stale_trials``), and
   Optuna's ``RetryHeartbeatStaleTrialCallback`` enqueues a copy (:data:`MAX_RETRY` per cell). A
   worker of this machine is judged by its process instead (:func:`settle_this_machine`): a dead
   one at once, a live one never.

The worker loop that runs this protocol is :mod:`sweep.run.worker`; the driver that enqueues and
starts workers is :mod:`sweep.run.driver`. On many machines each runs ``make sweep`` with
``MLFLOW_TRACKING_URI`` and ``STORAGE`` at the shared servers (docs/resuming.md, "Many workers").
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import optuna
from optuna.trial import FrozenTrial, TrialState

from experiments.names import Outcome
from sweep.grid import Cell
from sweep.run.resume import alive_here, own_start, worker_name
from sweep.run.runner import SweepContext
from sweep.studies import make_storage

MAX_RETRY = 3  # takeovers of one cell before it is left failed (a cell that kills its worker)
IN_FLIGHT = (TrialState.WAITING, TrialState.RUNNING)
CELL_ATTRS = ("run_key", "row", "seed", "force")  # a queue trial's user attributes name its cell
#: The user attribute of a popped trial: ``{"trial": its number, "worker": host:pid, "started":
#: that process's start time, "sweep": the sweep's name}``. Optuna's retry copies a failed
#: trial's attributes; the number tells a copy, not popped yet, from a trial its worker holds.
CLAIM_ATTR = "claim"
#: The environment variable that names a worker's sweep: its driver's ``host:pid``, set for the
#: worker processes and cluster jobs it starts (a worker started by hand is a sweep of its own).
SWEEP_ENV = "GATED_ATTN_SWEEP"


def own_sweep() -> str:
    """The sweep this process works for: :data:`SWEEP_ENV`, or this process (``host:pid``)."""
    return os.environ.get(SWEEP_ENV) or worker_name()


def sweep_of(trial: FrozenTrial) -> str | None:
    """The sweep whose worker popped ``trial`` (its claim's ``sweep``; a claim written before
    claims named one: its worker), or None while no worker has claimed it."""
    claim = trial.user_attrs.get(CLAIM_ATTR) or {}
    if claim.get("trial") != trial.number:  # not popped yet, or a retry's inherited claim
        return None
    return claim.get("sweep") or claim.get("worker")


def queue_name(scale: str) -> str:
    """The queue study of a scale, e.g. ``cells-tiny``: one for every grid, so a cell two grids
    share (the same ``run_key``) is queued, and trained, once."""
    return f"cells-{scale}"


@dataclass
class Queue:
    """The queue study and the storage calls that address its trials by id."""

    study: optuna.Study
    storage: optuna.storages.RDBStorage
    study_id: int
    shared: bool = False  # other machines may reach it (not a SQLite file): the fence is on

    def trial_id(self, trial: FrozenTrial) -> int:
        return self.storage.get_trial_id_from_study_id_trial_number(self.study_id, trial.number)

    def in_flight(self) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False, states=IN_FLIGHT)


def open_queue(scale: str, url: str, heartbeat_s: int) -> Queue:
    """Create (or load) the queue study of ``scale`` in the RDB storage at ``url``."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = make_storage(url, heartbeat_s, max_retry=MAX_RETRY)
    name = queue_name(scale)
    study = optuna.create_study(study_name=name, storage=storage, load_if_exists=True)
    return Queue(study, storage, storage.get_study_id_from_name(name), not url.startswith("sqlite"))


def enqueue_cells(queue: Queue, cells: list[Cell], ctx: SweepContext, force: bool) -> dict[str, int]:
    """Enqueue the runnable cells that need training and are not queued already.

    Returns:
        For each cell this sweep waits for (enqueued now, or already in flight), the number of
        its first trial that counts for this sweep.
    """
    first_new = len(queue.study.get_trials(deepcopy=False))
    in_flight: dict[str, int] = {}
    for t in queue.in_flight():
        key = t.user_attrs.get("run_key")
        in_flight[key] = min(t.number, in_flight.get(key, t.number))
    wanted: dict[str, int] = {}
    for cell in cells:
        if cell.run_key in wanted or (not force and ctx.tracker.current_result(cell) is not None):
            continue
        wanted[cell.run_key] = in_flight.get(cell.run_key, first_new)
        if cell.run_key not in in_flight:
            attrs = dict(zip(CELL_ATTRS, (cell.run_key, cell.row.id, cell.seed, force)))
            queue.study.enqueue_trial({}, user_attrs=attrs)
    return wanted


def pop_cell(
    queue: Queue, known: set[str], parents: dict[str, str] | None = None, sweep: str | None = None
) -> FrozenTrial | None:
    """Take one WAITING trial of a cell in ``known`` (RUNNING, its ``worker`` this process), or
    None. A later stage (``parents``: run key -> its parent's) waits while its parent's is in flight.

    ``set_trial_state_values(RUNNING)`` returns False for every process but the first, so one
    trial goes to exactly one worker (the same check-and-set as ``Study.ask``). Its first
    heartbeat is recorded at once: Optuna never fails a RUNNING trial that has none. Then its
    :data:`CLAIM_ATTR` names this process, and ``sweep`` (default :func:`own_sweep`)."""
    parents = parents or {}
    pending = {t.user_attrs.get("run_key") for t in queue.in_flight()} if parents else set()
    for trial in queue.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        key = trial.user_attrs.get("run_key")
        if key not in known:  # another version of the grid's
            continue
        if parents.get(key) in pending:  # its parent stage has not ended yet
            continue
        trial_id = queue.trial_id(trial)
        try:
            if queue.storage.set_trial_state_values(trial_id, state=TrialState.RUNNING):
                queue.storage.record_heartbeat(trial_id)
                queue.storage.set_trial_user_attr(trial_id, "worker", worker_name())
                claim = {"trial": trial.number, "worker": worker_name(), "started": own_start()}
                claim["sweep"] = sweep or own_sweep()
                queue.storage.set_trial_user_attr(trial_id, CLAIM_ATTR, claim)
                return trial
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
    return None


def settle_this_machine(queue: Queue) -> None:
    """Decide each RUNNING trial a process of this machine holds by that process, not by its
    heartbeat: alive (its pid is there and started when its claim says), the heartbeat is renewed
    (a machine that slept, a stalled heartbeat thread); gone (``kill -9``, the OOM killer, a
    reused pid, or this very process, which trains nothing while it looks), the trial is failed
    and put back at once by Optuna's retry, as for a stale heartbeat (``MAX_RETRY`` per cell).
    Other machines' workers are left to their heartbeats (``fail_stale_trials``)."""
    here = socket.gethostname()
    for trial in queue.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        claim = trial.user_attrs.get(CLAIM_ATTR) or {}
        host, _, pid = str(claim.get("worker", "")).rpartition(":")
        if claim.get("trial") != trial.number or host != here or not pid.isdigit():
            continue  # not popped yet (a retry copies its failed trial's claim), or not ours
        trial_id = queue.trial_id(trial)
        if claim["worker"] != worker_name() and alive_here(int(pid), claim.get("started")):
            queue.storage.record_heartbeat(trial_id)
            continue
        try:
            if not queue.storage.set_trial_state_values(trial_id, state=TrialState.FAIL):
                continue
        except optuna.exceptions.UpdateFinishedTrialError:
            continue
        retry = queue.storage.get_heartbeat_stale_trial_callback()  # as fail_stale_trials: MAX_RETRY
        if retry is not None:
            retry(queue.study, queue.storage.get_trial(trial_id))


def held_elsewhere(
    queue: Queue, known: set[str], parents: dict[str, str], sweep: str
) -> dict[str, FrozenTrial]:
    """The cells of ``known`` in flight that another sweep's live worker of this machine holds,
    which a sweep (``sweep``) must not wait for: run key -> the RUNNING trial of that worker, the
    cell's own or, for a later stage still WAITING, its parent's (or an earlier ancestor's).

    Such a worker is judged by its process (:func:`settle_this_machine`, called first): it is
    never taken over while the process exists, a stopped one (Ctrl-Z) included, so waiting for it
    could last for ever. Another machine's worker is waited for: it ends the cell, or its
    heartbeat lapses and the waiting sweep takes the cell over."""
    here = socket.gethostname()
    flying = [t for t in queue.in_flight() if t.user_attrs.get("run_key") in known | set(parents.values())]
    held = {}
    for t in flying:
        owner = sweep_of(t)
        worker = str((t.user_attrs.get(CLAIM_ATTR) or {}).get("worker", ""))
        if t.state == TrialState.RUNNING and owner not in (None, sweep) and worker.rpartition(":")[0] == here:
            held[t.user_attrs["run_key"]] = t
    waiting = {t.user_attrs["run_key"] for t in flying if t.state == TrialState.WAITING}
    grew = True
    while grew:  # a later stage waits on its parent: held when the parent is
        grew = False
        for key in waiting - set(held):
            if parents.get(key) in held:
                held[key], grew = held[parents[key]], True
    return {k: t for k, t in held.items() if k in known}


def older_twin(queue: Queue, trial: FrozenTrial) -> FrozenTrial | None:
    """An older WAITING or RUNNING trial of the same cell: that one trains it, not ``trial``."""
    key = trial.user_attrs["run_key"]
    twins = [t for t in queue.in_flight() if t.number < trial.number and t.user_attrs.get("run_key") == key]
    return twins[0] if twins else None


def record(
    queue: Queue, trial: FrozenTrial, outcome: str, note: str = "", avg_ppl: float | None = None
) -> bool:
    """Store the outcome (and the Avg PPL, as the trial's value) on the trial and end it:
    COMPLETE for a result, FAIL otherwise. A killed cell (Ctrl-C, a pre-empted machine), one not
    started before a signal, go straight back into the queue, for any worker still running.

    Returns False when the trial was no longer this worker's: its heartbeat lapsed and another
    worker failed it (and took the cell over)."""
    trial_id = queue.trial_id(trial)
    state = TrialState.COMPLETE if outcome in Outcome.RESULTS else TrialState.FAIL
    try:
        queue.storage.set_trial_user_attr(trial_id, "outcome", outcome)
        if note:
            queue.storage.set_trial_user_attr(trial_id, "note", note[:2000])
        queue.storage.set_trial_state_values(trial_id, state, None if avg_ppl is None else [avg_ppl])
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    if outcome in Outcome.REQUEUED:
        queue.study.enqueue_trial({}, user_attrs={k: trial.user_attrs[k] for k in CELL_ATTRS})
    return True
