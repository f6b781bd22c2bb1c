"""A cell on several processes: torchrun starts them, each runs :func:`main` of this module.

One machine: ``python -m torch.distributed.run --standalone --nproc-per-node D -m sweep.run.ranks
JOB``. Several machines, in one cluster job: ``srun --nodes M --ntasks-per-node 1 python -m
torch.distributed.run --nnodes M --nproc-per-node D --rdzv-backend c10d --rdzv-endpoint
HOST:PORT -m sweep.run.ranks JOB`` (torchtitan's and submitit's way); outside SLURM the M nodes
are M torchrun processes on this machine, meeting at the same endpoint. ``JOB`` is a pickled
``(function, arguments)`` (a module-level function; configs, paths) in a folder every node sees:
each rank calls it, reading its place from the environment torchrun sets (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); Lightning's
``TorchElasticEnvironment`` takes those places and launches nothing. On CPU the ranks talk over
gloo, on CUDA over NCCL (Lightning's choice for the accelerator).

Rank 0 writes what it returned, or what it raised, beside ``JOB`` (``JOB.out``); :func:`launch`
returns or raises it in the caller. A rank that raises exits 1, and torchrun ends the others.
Each rank handles SIGINT and SIGTERM as one process does (``sweep.signals``): it stops at
the next step's start, saved, which torchrun waits 30 s for (then SIGKILL). When the ranks end
without an outcome after a signal (one in a rank's first instant, or a stop that no step start
came to within those 30 s: the final validation, the probes), the cell ends ``killed``
(``sweep.run.cell.train_on_ranks``) and resumes from its last checkpoint.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sweep.signals import PREEMPTION, StopRequest, child_preexec, die_with_parent, wait_forwarding

#: This module, as torchrun runs it (``-m``) in every rank.
MODULE = "sweep.run.ranks"
#: Threads per rank on CPU: the ranks already share the machine's cores.
CPU_THREADS_PER_RANK = 1
#: A scheduler's environment, which Lightning could read the ranks' places from (its
#: SLURMEnvironment) instead of torchrun's: the ranks drop it.
SCHEDULER_PREFIXES = ("SLURM_",)

_stop: StopRequest | None = None  # this rank's, while :func:`main` runs


class RanksFailed(RuntimeError):
    """The ranks ended without rank 0's outcome: a rank raised (its traceback is in the lines
    above) or was killed."""


def free_port() -> int:
    """A TCP port nothing listens on now, on every interface (a rendezvous, a server)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def rank_stop() -> StopRequest | None:
    """This rank's :class:`~sweep.signals.StopRequest` (None outside :func:`main`)."""
    return _stop


def end_orphan_ranks(folder: Path, wait_s: float = 60.0) -> list[int]:
    """Wait up to ``wait_s`` seconds for this machine's processes of a job of ``folder`` (a dead
    worker's cell's checkpoint folder: its torchrun takes up to 30 s to stop its ranks, saved),
    then SIGKILL any left (hung: nobody waits for them). A job's process is one whose command
    line runs this module on a job file under ``folder`` (torchrun, srun, the ranks), nothing
    else that names the folder. Returns the pids killed."""
    import psutil

    job = f"{folder}{os.sep}.ranks-"

    def left() -> list[psutil.Process]:
        procs = psutil.process_iter(["pid", "cmdline"])
        ours = [(p, p.info["cmdline"] or []) for p in procs]
        return [p for p, cmd in ours if MODULE in cmd and any(a.startswith(job) for a in cmd)]

    deadline = time.monotonic() + wait_s
    while (found := left()) and time.monotonic() < deadline:
        time.sleep(0.5)
    for proc in found:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(found, timeout=10)
    return [p.pid for p in found]


def torchrun_command(
    job: Path, devices: int, nodes: int = 1, endpoint: str = "", job_id: str = ""
) -> list[str]:
    """torchrun's command for ``devices`` ranks per node on ``nodes`` nodes (``endpoint``
    ``host:port``, where node 0's rendezvous listens; ``job_id`` names the rendezvous)."""
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={devices}"]
    if nodes == 1:
        command.append("--standalone")
    else:
        command += [f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}"]
        command.append(f"--rdzv-id={job_id or 'cell'}")
    return [*command, "-m", MODULE, str(job)]


def node_commands(job: Path, devices: int, nodes: int, job_id: str = "") -> list[list[str]]:
    """The commands that start a cell's ranks: one torchrun on one machine; on ``nodes`` machines
    of a SLURM job, one ``srun`` of torchrun per node; elsewhere ``nodes`` torchrun here."""
    if nodes == 1:
        return [torchrun_command(job, devices)]
    host = socket.gethostname() if os.environ.get("SLURM_JOB_ID") else "127.0.0.1"
    command = torchrun_command(job, devices, nodes, f"{host}:{free_port()}", job_id)
    if os.environ.get("SLURM_JOB_ID") and shutil.which("srun"):
        # --overlap: the job's own step holds its CPUs; --mem=0: and its memory, where SLURM tracks it
        srun = ["srun", "--overlap", "--mem=0", f"--nodes={nodes}", "--ntasks-per-node=1"]
        srun.append("--kill-on-bad-exit=1")
        return [[*srun, *command]]
    return [command] * nodes


def launch(
    fn: Callable[..., Any],
    devices: int,
    *args: Any,
    nodes: int = 1,
    stop: StopRequest | None = None,
    folder: Path | None = None,
) -> Any:
    """Run ``fn(*args)`` on ``devices`` ranks per node on ``nodes`` nodes (torchrun), and return
    what global rank 0 returned.

    ``fn`` and ``args`` must pickle. ``folder`` holds the job file (every node must see it: the
    cell's checkpoint folder; default a temporary folder). Once ``stop`` holds a signal, torchrun
    gets SIGTERM and passes it to the ranks; a killed caller's torchrun gets SIGTERM too.

    Raises:
        BaseException: what rank 0 raised, raised again here.
        RanksFailed: no rank 0 outcome (another rank raised, a rank was killed).
        ValueError: ``devices`` or ``nodes`` below 1.
    """
    if devices < 1 or nodes < 1:
        raise ValueError(f"devices and nodes must be at least 1, got {devices} and {nodes}")
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".ranks-", dir=folder) as tmp:
        job = Path(tmp) / "job.pkl"
        job.write_bytes(pickle.dumps((fn, args)))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "PYTHONUNBUFFERED": "1"}
        if not _cuda():
            env.setdefault("OMP_NUM_THREADS", str(CPU_THREADS_PER_RANK))
        preexec = child_preexec(os.getpid())
        procs = [
            subprocess.Popen(c, env=env, preexec_fn=preexec)
            for c in node_commands(job, devices, nodes, job.parent.name)
        ]
        try:
            wait_forwarding(procs, stop)
        except BaseException:  # a second Ctrl-C: torchrun ends its ranks (SIGTERM, 30 s later SIGKILL)
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            raise
        out = job.with_suffix(".out")
        if not out.exists():
            codes = ", ".join(str(p.returncode) for p in procs)
            raise RanksFailed(f"torchrun exited {codes} without rank 0's outcome (a rank failed: see above)")
        ok, value = pickle.loads(out.read_bytes())
    if not ok:
        raise value
    return value


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    """One rank (``python -m sweep.run.ranks JOB`` under torchrun): run the job's function; rank
    0 writes its outcome. Exit 0, or 1 when it raised."""
    global _stop
    job = Path((argv if argv is not None else sys.argv[1:])[0])
    # First, before torch loads (seconds): the signals, and death with torchrun, which ends its
    # ranks itself when it can.
    signal.signal(PREEMPTION, signal.SIG_IGN)
    die_with_parent(os.getppid(), signal.SIGKILL)
    with StopRequest(rank=True) as _stop:
        for name in [n for n in os.environ if n.startswith(SCHEDULER_PREFIXES)]:
            del os.environ[name]
        import torch

        if not torch.cuda.is_available():
            torch.set_num_threads(CPU_THREADS_PER_RANK)
        rank = int(os.environ["RANK"])
        try:
            fn, args = pickle.loads(job.read_bytes())
            outcome, code = (True, fn(*args)), 0
        except Exception as err:
            traceback.print_exc()
            outcome, code = (False, _picklable(err)), 1
    if rank == 0:  # written whole, then renamed: the caller never reads half a file
        tmp = job.with_suffix(".tmp")
        tmp.write_bytes(pickle.dumps(outcome))
        tmp.replace(job.with_suffix(".out"))
    return code


def _picklable(err: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(err))
        return err
    except Exception:
        return RuntimeError(f"{type(err).__name__}: {err}")


if __name__ == "__main__":  # run as sweep.run.ranks, not __main__: rank_stop() reads its global
    from sweep.run.ranks import main as rank_main

    sys.exit(rank_main())
