"""Queue workers as cluster jobs: ``make sweep LAUNCHER=slurm WORKERS=N PARTITION=...``.

The driver (:func:`sweep.run.driver.run_queued_sweep`) prepares the store and the corpus and
enqueues the cells as for local workers; then, instead of starting N processes, it submits N jobs
with `submitit <https://github.com/facebookincubator/submitit>`_ (SLURM, or submitit's
``LocalExecutor`` with ``--launcher submitit-local``, which runs the same jobs on this machine) and
waits for them. Each job (:class:`WorkerJob`) runs one ``python -m sweep.cli worker`` in a child
process, which pops cells from the shared queue until none is left, exactly as a local worker.

Pre-emption and time limits (docs/cluster.md):

- SLURM cancels a job (``scancel``), requeues it (``scontrol requeue``) or pre-empts it with
  SIGTERM, then SIGKILL after ``KillWait`` or the partition's grace time. The worker gets the
  SIGTERM (SLURM signals every process of the job's steps; the job forwards it too), saves its
  cell's training state at the next step, marks the run killed and puts the cell back in the
  queue. Jobs are submitted with ``--requeue``: with ``PreemptMode=REQUEUE`` SLURM puts a job
  pre-empted without a grace time back in line itself; one pre-empted with a grace time, which
  would end ``COMPLETED`` before SLURM kills it, requeues itself
  (:func:`~sweep.run.slurm_jobs.preempted_with_grace`). A cancelled job stays cancelled. Another
  worker, or the requeued job, resumes the cell from its checkpoint.
- submitit's own signal (``--signal=USR2@90``: 90 s before the time limit, or at pre-emption
  where the cluster sends a job's signal then, ``preempt_send_user_signal``) calls
  :meth:`WorkerJob.checkpoint`: the worker is stopped the same way, then submitit requeues the
  job (at most ``max_timeouts`` times for time limits). ``TIME_LIMIT`` must leave a job
  :data:`MIN_TRAIN_S` before that signal (:func:`check_time_limit`).
- The driver follows each job through its requeues until SLURM says it ended
  (:class:`~sweep.run.slurm_jobs.JobWatch`), then writes the tables.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from sweep.run import slurm_jobs
from sweep.signals import child_preexec, die_with_parent, wait_forwarding

if TYPE_CHECKING:  # lightning loads with it; the CLI's parser imports this module
    from sweep.signals import StopRequest

#: ``--launcher``: local processes, SLURM jobs, or the SLURM path run by submitit on this machine.
LAUNCHERS = ("local", "slurm", "submitit-local")
#: Environment a job passes on to its worker (besides what the cluster exports).
CARRIED_ENV = ("MLFLOW_TRACKING_URI", "GATED_ATTN_CACHE", "SWEEP_SYSTEM_METRICS", "HF_HOME")
POLL_S = 0.5  # how often a job looks at its worker
#: submitit's warning before a job's time limit (``--signal=USR2@90``, its ``signal_delay_s``).
SIGNAL_MARGIN_S = 90
#: The least a job must train before that warning: start-up (imports, the store, the corpus)
#: and a few steps. A shorter ``TIME_LIMIT`` is refused before anything is submitted.
MIN_TRAIN_S = 90

_worker: subprocess.Popen | None = None  # the running job's worker (a module global: jobs are pickled)


class LauncherError(RuntimeError):
    """The jobs cannot be submitted (no submitit, no SLURM here): one line, before anything starts."""


@dataclass
class ClusterSettings:
    """How the workers' jobs are submitted (``make sweep LAUNCHER=slurm`` variables)."""

    launcher: str = "slurm"  # "slurm" or "submitit-local"
    folder: Path = Path("results/slurm")  # submitit's job files and logs, one folder per job
    partition: str | None = None  # PARTITION
    gpus_per_worker: int = 1  # GPUS_PER_WORKER (the CLI gives gpus_per_job: the cells' train.devices)
    cpus_per_worker: int = 8  # CPUS_PER_WORKER: data loading, the corpus build, the probes
    time_limit_min: int = 240  # TIME_LIMIT, minutes per job (a requeued job starts a new one)
    max_timeouts: int = 3  # requeues after a time limit before a job is left ended
    nodes: int = 1  # machines per job: the cells' train.num_nodes (their ranks: srun torchrun)
    extra: dict[str, Any] = field(default_factory=dict)  # more submitit parameters (tests)


def make_executor(settings: ClusterSettings) -> Any:
    """A submitit executor for ``settings`` (``slurm``, or ``local`` for ``submitit-local``).

    Raises:
        LauncherError: submitit is not installed, or ``slurm`` where there is no ``srun``.
    """
    try:
        import submitit
    except ImportError:
        raise LauncherError(
            f"--launcher {settings.launcher} needs submitit: pip install 'submitit>=1.5' (a core dependency)"
        ) from None
    cluster = "slurm" if settings.launcher == "slurm" else "local"
    try:
        executor = submitit.AutoExecutor(
            folder=settings.folder / "%j", cluster=cluster, slurm_max_num_timeout=settings.max_timeouts
        )
    except RuntimeError as err:  # no srun on this machine
        raise LauncherError(f"--launcher {settings.launcher}: {err}") from None
    params: dict[str, Any] = {
        "name": "gated-attn-worker",
        "timeout_min": settings.time_limit_min,
        "cpus_per_task": settings.cpus_per_worker,
        # One task per node; task 0's worker starts each cell's ranks on every node (srun
        # torchrun). submitit's LocalExecutor has one node: the worker starts the "nodes" here.
        "tasks_per_node": 1,
        "nodes": 1 if cluster == "local" else settings.nodes,
        "slurm_additional_parameters": {"requeue": True},
        # --signal=USR2@90: before the time limit, and at pre-emption where the cluster sends it
        # then (preempt_send_user_signal)
        "slurm_signal_delay_s": SIGNAL_MARGIN_S,
    }
    if settings.gpus_per_worker > 0:  # none: no --gpus-per-node=0, which some clusters refuse
        params["gpus_per_node"] = settings.gpus_per_worker
    if settings.partition:
        params["slurm_partition"] = settings.partition
    executor.update_parameters(**{**params, **settings.extra})
    return executor


def _task_index() -> int:
    """This task's index in its submitit job (0 for a job of one task)."""
    import submitit

    return submitit.JobEnvironment().global_rank


@dataclass
class WorkerJob:
    """One submitit job: a queue worker (``command``) run in ``cwd`` as a child process.

    Called by submitit on the node; returns the worker's exit status. SIGTERM or SIGINT to the job
    is passed on to the worker (which saves its cell and leaves); submitit's pre-emption signal
    calls :meth:`checkpoint`."""

    command: list[str]
    cwd: str
    env: dict[str, str]

    def __call__(self) -> int:
        global _worker
        # submitit-local's pre-emption signal (SIGUSR2) to the job id kills the job's controller,
        # our parent, and nothing else: hear of it as a SIGTERM, which stops the worker saved.
        die_with_parent(os.getppid(), signal.SIGTERM)
        if _task_index() > 0:  # a job of several nodes: task 0's worker runs their ranks (srun)
            return 0
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        _worker = subprocess.Popen(self.command, cwd=self.cwd, env=env, preexec_fn=child_preexec(os.getpid()))
        previous = {sig: signal.signal(sig, self._stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = _wait_for_worker()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if code in (130, 143):
            print(f"worker stopped by a signal (status {code}); its cell is back in the queue", flush=True)
            job_id = os.environ.get("SLURM_JOB_ID")
            if job_id and slurm_jobs.preempted_with_grace(job_id):
                # else it ends COMPLETED, its grace time unused, and never runs again
                took = "requeued" if slurm_jobs.requeue(job_id) else "could not requeue"
                print(f"pre-empted with a grace time: {took} job {job_id}", flush=True)
        return code

    def _stop(self, signum: int = signal.SIGTERM, frame: FrameType | None = None) -> None:
        """Ask the worker to save its cell and leave (SIGTERM; a second one changes nothing)."""
        if _worker is not None and _worker.poll() is None:
            _worker.send_signal(signal.SIGTERM)

    def checkpoint(self) -> Any:
        """submitit's hook on pre-emption or an approaching time limit: stop the worker, wait
        until its cell is saved and back in the queue, and have the job requeued as it is."""
        from submitit.helpers import DelayedSubmission

        print("pre-emption or time limit: stopping the worker, then requeueing this job", flush=True)
        self._stop()
        _wait_for_worker()
        return DelayedSubmission(self)


def _wait_for_worker() -> int:
    """The worker's exit status (0 when none was started yet)."""
    if _worker is None:
        return 0
    wait_forwarding([_worker], None, POLL_S)
    return _worker.returncode


class SubmititLauncher:
    """Starts the driver's workers as submitit jobs and waits for them (the ``launch`` argument of
    :func:`sweep.run.driver.run_queued_sweep`)."""

    def __init__(self, settings: ClusterSettings, poll_s: float = 5.0) -> None:
        """Raises:
        LauncherError: see :func:`make_executor` (checked here, before the sweep starts)."""
        self.settings, self.poll_s = settings, poll_s
        self.on_slurm = settings.launcher == "slurm"
        self.executor = make_executor(settings)
        self.jobs: list[Any] = []

    def __call__(
        self,
        command: list[str],
        count: int,
        stop: StopRequest,
        out: Callable[[str], None],
        env: dict[str, str],
    ) -> None:
        """Submit ``count`` jobs of ``command`` (their workers get ``env`` added to the environment)
        and wait until every one has ended, on SLURM through its requeues (a line for each new
        state), then say how each ended. A signal to the driver cancels them (each worker saves
        its cell)."""
        carried = {**{k: os.environ[k] for k in CARRIED_ENV if k in os.environ}, **env}
        from sweep.run.placement import NODES_ENV  # loads torch: not at the top, the CLI parser imports us

        carried[NODES_ENV] = str(self.settings.nodes)
        job = WorkerJob(command, os.getcwd(), carried)
        self.jobs = [self.executor.submit(job) for _ in range(count)]
        ids = ", ".join(str(j.job_id) for j in self.jobs)
        out(f"submitted {count} {self.settings.launcher} jobs ({ids}); logs in {self.settings.folder}/<job>")
        watch = slurm_jobs.JobWatch([str(j.job_id) for j in self.jobs], out) if self.on_slurm else None
        cancelled = False
        while not (watch.poll() if watch else all(j.done() for j in self.jobs)):
            if stop.signum is not None and not cancelled:
                for j in self.jobs:
                    j.cancel(check=False)
                cancelled = True
            time.sleep(self.poll_s)
        for j in self.jobs:  # read after the end: on SLURM as scontrol or sacct reports it
            state = watch.last[str(j.job_id)] if watch else slurm_jobs.JobState(j.state)
            log = "" if state.state in ("COMPLETED", "FINISHED") else f"; its log: {j.paths.stdout}"
            out(f"job {j.job_id} ended {state.describe()}{log}")
        self.jobs = []  # let them go now: submitit's LocalJob fails in __del__ at interpreter exit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``sweep`` command's launcher flags (Makefile ``LAUNCHER``, ``PARTITION``,
    ``GPUS_PER_WORKER``, ``CPUS_PER_WORKER``, ``TIME_LIMIT``)."""
    default = ClusterSettings()
    parser.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="local",
        help="local: worker processes here; slurm: one SLURM job per worker (submitit); "
        "submitit-local: the slurm path run on this machine",
    )
    parser.add_argument("--partition", default=None, help="SLURM partition (default: the cluster's)")
    parser.add_argument(
        "--gpus-per-worker",
        type=int,
        default=None,
        help="GPUs per job and node (default: the cells' train.devices)",
    )
    parser.add_argument("--cpus-per-worker", type=int, default=default.cpus_per_worker, help="CPUs per job")
    parser.add_argument(
        "--time-limit", type=int, default=default.time_limit_min, help="minutes per job (then requeued)"
    )


def check_time_limit(minutes: int) -> None:
    """Refuse a ``TIME_LIMIT`` that leaves a job less than :data:`MIN_TRAIN_S` before submitit's
    warning, :data:`SIGNAL_MARGIN_S` before the limit: such a job is warned as it starts, and its
    requeues (three for time limits) run out with its cell hardly begun. The CLI asks first,
    before anything is written.

    Raises:
        LauncherError: one line, before anything is submitted.
    """
    least = -(-(SIGNAL_MARGIN_S + MIN_TRAIN_S) // 60)
    if minutes < least:
        raise LauncherError(
            f"--time-limit {minutes}: a job is warned {SIGNAL_MARGIN_S} s before its limit (--signal=USR2@"
            f"{SIGNAL_MARGIN_S}) and needs {MIN_TRAIN_S} s before that to start and train: give "
            f"TIME_LIMIT={least} minutes or more"
        )


def gpus_per_job(asked: int | None, devices: int) -> int:
    """GPUs per node of each job: ``asked`` (``GPUS_PER_WORKER``), else the cells' ``train.devices``
    (their ranks per node). 0 asks for none (a CPU cluster: the ranks use gloo).

    Raises:
        LauncherError: ``asked`` is between 1 and ``devices``: the ranks of a cell would share GPUs.
    """
    if asked is None:
        return devices
    if 0 < asked < devices:
        raise LauncherError(
            f"--gpus-per-worker {asked}: the cells train on {devices} devices a node (train.devices), "
            f"one GPU a rank: give GPUS_PER_WORKER={devices}, or leave it unset"
        )
    return asked


def launcher_for(args: argparse.Namespace, nodes: int = 1, devices: int = 1) -> SubmititLauncher | None:
    """The launcher the flags ask for, its jobs of ``nodes`` nodes of :func:`gpus_per_job` GPUs
    for cells of ``devices`` ranks a node; None for local processes.

    Raises:
        LauncherError: see :func:`make_executor` and :func:`gpus_per_job`.
    """
    if args.launcher == "local":
        return None
    settings = ClusterSettings(
        launcher=args.launcher,
        folder=Path(args.results) / "slurm",
        partition=args.partition,
        gpus_per_worker=gpus_per_job(args.gpus_per_worker, devices),
        cpus_per_worker=args.cpus_per_worker,
        time_limit_min=args.time_limit,
        nodes=nodes,
    )
    return SubmititLauncher(settings)
