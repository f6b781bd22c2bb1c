"""The sweep's driver, ``make sweep WORKERS=N`` (``python -m sweep.cli sweep --workers N``):

1. It checks the tracking store, builds the corpora and creates the MLflow experiment before any
   worker starts (two workers creating one SQLite store at once can fail).
2. It enqueues each cell that needs training (:func:`sweep.run.queue.enqueue_cells`).
3. It starts N workers (:mod:`sweep.run.worker`) and waits for them: processes of this machine
   (:func:`start_processes`), cluster jobs (``sweep.run.slurm.SubmititLauncher``), or, for one
   local worker, a :func:`~sweep.run.worker.drain` in its own process.
4. It reads back one outcome per cell (:func:`sweep.run.summary.queue_outcomes`); the CLI prints
   the summary and writes the tables.

SIGINT and SIGTERM reach the workers; each saves its cell and marks it killed.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from experiments.names import Outcome
from sweep.grid import Cell, Grid
from sweep.run.gpus import worker_environments
from sweep.run.queue import SWEEP_ENV, enqueue_cells, open_queue, queue_name
from sweep.run.resume import worker_name
from sweep.run.runner import CellResult, prepare_sweep
from sweep.run.summary import queue_outcomes
from sweep.run.worker import drain
from sweep.signals import StopRequest, child_preexec, wait_forwarding
from sweep.store_urls import STORAGE_ENV, hide_password

#: Starts the workers' command ``count`` times with the environment given added, and waits for them.
Launcher = Callable[[list[str], int, StopRequest, Callable[[str], None], dict[str, str]], object]


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
    GPUs (:func:`sweep.run.gpus.worker_environments`, ``cells_per_gpu`` to a card); cluster jobs
    keep the GPUs their scheduler gives them."""
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
    sweep = worker_name()  # the sweep's name in the queue's claims: this driver's
    if count == 1 and launch is None:
        drained = drain(queue, cells, ctx, heartbeat_s, alone=len(wanted), sweep=sweep)
        mine = {o.cell.run_key: o for o in drained}
        try:
            found = queue_outcomes(queue, cells, wanted, ctx, sweep)
        except Exception:  # the fence stopped the worker: the queue's database still does not answer
            if stop.signum is None:
                raise
            return list(mine.values())
        # an outcome the fence kept from being recorded: as this worker saw it
        return [mine.get(o.cell.run_key, o) if o.status == Outcome.NOT_STARTED else o for o in found]
    command = [sys.executable, "-m", "sweep.cli", "worker", *worker_args]  # each pins its threads
    env = {STORAGE_ENV: url, SWEEP_ENV: sweep}  # the URL not in the command line, which every user can read
    if count and launch is not None:
        launch(command, count, stop, out, env)
    elif count:
        devices = max(c.config.train.devices for c in cells)
        start_processes(command, count, stop, out, env, worker_environments(count, devices, cells_per_gpu))
    return queue_outcomes(queue, cells, wanted, ctx, sweep)


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
