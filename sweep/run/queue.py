"""Every sweep's cells go through one work queue in Optuna's RDB storage, one worker or many, on
one machine or many: the one liveness rule (a cell is alive while its worker is: a process of
this machine while it exists, another machine's while its heartbeat is fresh).

``make sweep WORKERS=N`` (``python -m sweep.cli sweep --workers N``) is the driver. It checks the
tracking store, builds the corpora and creates the MLflow experiment before any worker starts;
enqueues, as a WAITING trial of the study ``cells-<scale>`` (one queue for every grid of a scale),
each cell without a result (every cell with ``--force``) and no trial in flight, named by the
trial's user attributes (``run_key``, ``row``, ``seed``, ``force``); starts N worker processes
(``python -m sweep.cli worker``; one worker runs in its own process) and waits for them; then
summarises and writes the tables.

A worker pops WAITING trials one at a time with Optuna's check-and-set
(``set_trial_state_values(RUNNING)`` succeeds for exactly one process), beats a heartbeat while
it trains the cell with ``run_cell`` (a cell that died resumes from its checkpoint in its own
MLflow run), and records the outcome on the trial. A dead worker stops beating; three heartbeats
later the next worker that looks fails its trial and Optuna's ``RetryHeartbeatStaleTrialCallback``
enqueues a copy, which another worker takes over; a worker of this machine is judged by its
process instead (:func:`settle_this_machine`: a dead one at once, a live one never). On a queue
other machines reach, a worker whose heartbeat goes unrecorded for two intervals stops its cell,
saved, and leaves before anyone takes it over (the fence, :class:`~sweep.run.resume.Heartbeat`).
Workers leave when nothing is WAITING or RUNNING; a popped trial defers to an older one of the
same cell (two drivers enqueued it at once). On many machines each runs ``make sweep`` with
``MLFLOW_TRACKING_URI`` and ``STORAGE`` at the shared servers (docs/resuming.md, "Many workers").
"""

from __future__ import annotations

import functools
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial, TrialState

from experiments.names import Outcome
from sweep.grid import Cell, Grid
from sweep.run.gpus import worker_environments
from sweep.run.placement import job_nodes
from sweep.run.progress import SweepClock
from sweep.run.resume import Heartbeat, alive_here, own_start, worker_name
from sweep.run.runner import CellResult, SweepContext, prepare_sweep, run_cell
from sweep.signals import StopRequest, child_preexec, wait_forwarding
from sweep.store_urls import STORAGE_ENV, hide_password
from sweep.studies import make_storage

POLL_S = 2.0  # how often an idle worker looks for work or for a dead worker's cell
MAX_RETRY = 3  # takeovers of one cell before it is left failed (a cell that kills its worker)
IN_FLIGHT = (TrialState.WAITING, TrialState.RUNNING)
#: Starts the workers' command ``count`` times, waits for them, returns their names (``host:pid``) or None.
Launcher = Callable[[list[str], int, StopRequest, Callable[[str], None]], "set[str] | None"]
CELL_ATTRS = ("run_key", "row", "seed", "force")  # a queue trial's user attributes name its cell
#: The user attribute of a popped trial: ``{"trial": its number, "worker": host:pid, "started":
#: that process's start time}``. Optuna's retry copies a failed trial's attributes; the number
#: tells a copy, not popped yet, from a trial its worker holds.
CLAIM_ATTR = "claim"


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


def pop_cell(queue: Queue, known: set[str], parents: dict[str, str] | None = None) -> FrozenTrial | None:
    """Take one WAITING trial of a cell in ``known`` (RUNNING, its ``worker`` this process), or
    None. A later stage (``parents``: run key -> its parent's) waits while its parent's is in flight.

    ``set_trial_state_values(RUNNING)`` returns False for every process but the first, so one
    trial goes to exactly one worker (the same check-and-set as ``Study.ask``). Its first
    heartbeat is recorded at once: Optuna never fails a RUNNING trial that has none. Then its
    :data:`CLAIM_ATTR` names this process."""
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
) -> list[CellResult]:
    """Pop and train cells of ``cells`` until the queue has none WAITING or RUNNING, or a signal
    arrives. Returns the outcomes of the cells this worker took.

    ``alone`` (the number of cells the sweep queued) makes this the sweep's one worker, in the
    sweep's own process (``WORKERS=1``): its lines number the cells ``[i/n]``. Like any worker
    it waits for the cells other workers of this queue train (one of them may die)."""
    stop, out = ctx.stop, ctx.out
    by_key = {c.run_key: c for c in reversed(cells)}  # the first cell of each config, as enqueued
    parents = {c.run_key: c.parent.run_key for c in cells if c.parent is not None}
    clock = SweepClock(alone or len(by_key))
    me = worker_name()
    outcomes: list[CellResult] = []
    while stop.signum is None:
        settle_this_machine(queue)  # first: a live worker of this machine is never failed
        optuna.storages.fail_stale_trials(queue.study)  # a dead worker's cell goes back as WAITING
        popped, trial = time.monotonic(), pop_cell(queue, set(by_key), parents)
        if trial is None:
            if not {t.user_attrs.get("run_key") for t in queue.in_flight()} & set(by_key):
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


def run_queued_sweep(
    grid: Grid,
    cells: list[Cell],
    results_dir: Path,
    workers: int,
    url: str,
    worker_args: list[str],
    heartbeat_s: int,
    force: bool,
    cache_root: Path | None,
    stop: StopRequest,
    out: Callable[[str], None] = print,
    launch: Launcher | None = None,
    default_queue: bool = False,
    cells_per_gpu: int = 1,
) -> list[CellResult]:
    """The driver: prepare, enqueue, start ``workers`` workers, wait, and return one
    :class:`CellResult` per cell (read back from the queue). ``worker_args``: the ``sweep.cli
    worker`` arguments that name the same grid, scale, seeds, rows, results folder and storage.
    ``launch`` starts the workers and waits for them (:func:`start_processes` by default;
    :class:`sweep.run.slurm.SubmititLauncher` for cluster jobs). One local worker runs in this
    process (:func:`drain` ``alone``), not importing torch, Lightning, MLflow and Optuna again.
    SIGINT and SIGTERM reach the workers; each saves its cell and marks it killed.
    ``default_queue``: ``url`` is the results folder's own queue, not one the user named (see
    :func:`sweep.run.runner.check_one_queue`). Local workers on a GPU machine each see their own
    GPUs (:func:`sweep.run.gpus.worker_environments`, ``cells_per_gpu`` to a card)."""
    nodes = None if launch else 1
    ctx = prepare_sweep(grid, cells, results_dir, cache_root, stop, out, nodes, default_queue)
    queue = open_queue(cells[0].scale, url, heartbeat_s)
    wanted = enqueue_cells(queue, cells, ctx, force)
    stop.arm()
    unique = len({c.run_key for c in cells})
    out(
        f"sweep {grid.name} at scale {cells[0].scale}: {len(cells)} cells, {len(wanted)} to train, "
        f"{unique - len(wanted)} finished earlier; tracking {ctx.tracker.uri}; "
        f"queue {queue_name(cells[0].scale)} in {hide_password(url)} for {workers} "
        f"worker{'s' if workers > 1 else ''}"
    )
    count = workers if wanted and stop.signum is None else 0
    if count == 1 and launch is None:
        mine = {o.cell.run_key: o for o in drain(queue, cells, ctx, heartbeat_s, alone=len(wanted))}
        try:
            found = queue_outcomes(queue, cells, wanted, ctx, {worker_name()})
        except Exception:  # the fence stopped the worker: the queue's database still does not answer
            if stop.signum is None:
                raise
            return list(mine.values())
        # an outcome the fence kept from being recorded: as this worker saw it
        return [mine.get(o.cell.run_key, o) if o.status == Outcome.NOT_STARTED else o for o in found]
    command = [sys.executable, "-m", "sweep.cli", "worker", *worker_args]  # each pins its threads
    env = {STORAGE_ENV: url}  # not in the command line, which every user of the machine can read
    if launch is not None:  # cluster jobs keep the GPUs their scheduler gives them
        own = launch(command, count, stop, out, env) if count else set()
    else:
        devices = max(c.config.train.devices for c in cells)
        gpus = worker_environments(count, devices, cells_per_gpu)
        own = start_processes(command, count, stop, out, env, gpus) if count else set()
    return queue_outcomes(queue, cells, wanted, ctx, own)


def start_processes(
    command: list[str],
    count: int,
    stop: StopRequest,
    out: Callable[[str], None],
    env: dict[str, str],
    each: list[dict[str, str]] | None = None,
) -> set[str]:
    """Run ``count`` worker processes of ``command`` on this machine, with ``env`` (and worker
    ``i``'s ``each[i]``, its GPUs) added to their environment, until each has left; forward
    SIGTERM to them once the driver got a signal (Ctrl-C reaches them by itself). A driver killed
    outright (``kill -9``, the OOM killer) sends them SIGTERM through the kernel
    (``PR_SET_PDEATHSIG``): each saves its cell and leaves, none trains on orphaned. Returns
    their names (``host:pid``)."""
    env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}  # progress lines as they come, into a log file too
    preexec = child_preexec(os.getpid())
    each = each or [{} for _ in range(count)]
    procs = [subprocess.Popen(command, env={**env, **each[i]}, preexec_fn=preexec) for i in range(count)]
    wait_forwarding(procs, stop)
    for i, p in enumerate(procs):
        if p.returncode not in (0, 1, 130, 143):
            out(f"worker {i} (pid {p.pid}) exited with status {p.returncode}")
    return {f"{socket.gethostname()}:{p.pid}" for p in procs}


def queue_outcomes(
    queue: Queue, cells: list[Cell], wanted: dict[str, int], ctx: SweepContext, own: set[str] | None = None
) -> list[CellResult]:
    """One outcome per cell: skipped (a result before this sweep), or the last outcome a worker
    recorded on one of its trials from ``wanted[run_key]`` on (trial numbers, not clocks: the
    workers may be on other machines); ``skipped`` never replaces an earlier outcome (a younger
    twin, taken after the older one's result, only finds that result). With ``own`` (this
    sweep's workers, ``host:pid``), a cell another sweep's worker took reads ``skipped``, its note
    saying who and what: the summary counts what this sweep did."""
    last: dict[str, FrozenTrial] = {}
    for t in queue.study.get_trials(deepcopy=False):  # in trial-number order
        key, recorded = t.user_attrs.get("run_key"), t.user_attrs.get("outcome")
        if key in wanted and recorded and recorded != Outcome.DUPLICATE and t.number >= wanted[key]:
            if recorded == Outcome.SKIPPED and key in last:  # a younger twin found the result
                continue
            last[key] = t
    queued = set(wanted)
    pending = {t.user_attrs.get("run_key") for t in queue.in_flight()}
    running = {
        t.user_attrs.get("run_key"): t.user_attrs.get("worker", "another worker")
        for t in queue.in_flight()
        if t.state == TrialState.RUNNING
    }
    outcomes = []
    for cell in cells:
        if cell.run_key not in queued:
            outcomes.append(CellResult(cell, Outcome.SKIPPED, note="finished earlier"))
        elif cell.run_key in last:
            t = last[cell.run_key]
            worker, outcome = t.user_attrs.get("worker", "?"), t.user_attrs["outcome"]
            if own is not None and worker not in own:
                note = f"{outcome} by another sweep's worker {worker}"
                outcomes.append(CellResult(cell, Outcome.SKIPPED, note=note))
            else:
                outcomes.append(CellResult(cell, outcome, note=t.user_attrs.get("note", "")))
        elif ctx.tracker.current_result(cell) is not None:
            outcomes.append(CellResult(cell, Outcome.SKIPPED, note="finished by another sweep"))
        elif ctx.stop.signum is not None:
            outcomes.append(CellResult(cell, Outcome.NOT_STARTED, note="the sweep was interrupted"))
        elif own is not None and cell.run_key in running and (worker := running[cell.run_key]) not in own:
            outcomes.append(CellResult(cell, Outcome.BUSY, note=f"being trained by {worker}"))
        elif cell.run_key in pending:  # this machine's workers died: another's, or a rerun, take it
            note = "still in the queue: another machine's worker or the same command again trains it"
            outcomes.append(CellResult(cell, Outcome.FAILED, note=note))
        else:
            note = "no worker finished it (see the workers' output)"
            outcomes.append(CellResult(cell, Outcome.FAILED, note=note))
    return outcomes
