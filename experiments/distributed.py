"""Several training processes on one machine from a library call, as ``torchrun`` would start them.

Lightning's ``strategy="ddp"`` starts its other processes by re-running ``sys.argv`` (the
subprocess launcher): right for ``python train.py``, wrong for a test or a sweep worker, whose
command line is not a training script. :func:`spawn_ranks` instead starts ``world`` fresh
interpreters (``torch.multiprocessing``, start method ``spawn``), each with the environment
``torchrun`` sets (``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``NODE_RANK``, ``LOCAL_RANK``,
``RANK``). Lightning's default cluster environment then takes the processes as created externally
and launches nothing: each process builds its own :class:`~experiments.train.Training` with
``devices = world`` and is one rank of it. On CPU the processes talk over gloo, on CUDA over NCCL
(Lightning's choice for the accelerator).

A cell on several machines runs :func:`spawn_ranks` on each, with a :class:`NodePlace` saying
which share of the global ranks is this machine's (``sweep.run.nodes`` tells each machine).

Every rank runs the whole recipe: fit, every validation and the probes, on the same held-out
windows and probe batch (no collective there: a MoE's balancing all-reduces in training only);
rank 0 alone writes checkpoint files and logs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

#: Threads per rank on CPU: the ranks already share the machine's cores.
CPU_THREADS_PER_RANK = 1
#: Signals the ranks ignore from their first instruction: a terminal's Ctrl-C, SLURM's SIGTERM
#: and submitit's pre-emption signal reach every process of the job; the sweep's process decides
#: (``sweep.run.interrupt``: it tells the ranks through a file) and ends them itself.
RANK_IGNORES = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)
#: The environment of a scheduler that Lightning would read the ranks' places from (its
#: SLURMEnvironment) over the torchrun-style variables :func:`spawn_ranks` sets.
SCHEDULER_PREFIXES = ("SLURM_",)


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (the rendezvous of the ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Opened once at import: ``die_with_parent`` also runs between fork and exec (``preexec_fn``),
# where a dlopen could wait forever on a lock another thread of the parent held.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent: int, sig: int = signal.SIGKILL) -> None:
    """Have the kernel send ``sig`` (SIGKILL) to this process when the process that started it
    dies (Linux's ``PR_SET_PDEATHSIG``; elsewhere nothing): a sweep worker killed with ``kill -9``
    leaves no rank training on, and writing into its run, behind it. With SIGTERM the process can
    still save its cell (a worker whose launcher died)."""
    if _LIBC is not None:
        _LIBC.prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before the line above: nothing would signal us
            os._exit(1)


@dataclass(frozen=True)
class NodePlace:
    """Where this machine's ranks sit in a job of several machines (``sweep.run.nodes``).

    Attributes:
        node_rank: this machine's index, 0 .. num_nodes-1 (node 0 holds global rank 0).
        num_nodes: machines in the job.
        master_addr: node 0's address, where every rank meets (``MASTER_ADDR``).
        master_port: a port free on node 0 (``MASTER_PORT``), one per cell.
    """

    node_rank: int
    num_nodes: int
    master_addr: str
    master_port: int


class NodeFailed(RuntimeError):
    """Another machine's ranks of this cell failed (its one line in the message); ours were ended."""


def _rank_main(
    local_rank: int,
    parent: int,
    local_world: int,
    place: NodePlace,
    fn: Callable[..., Any],
    args: tuple,
    out: str,
) -> None:
    for sig in RANK_IGNORES:  # blocked since the start (spawn_ranks); ignored from here, then let in
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RANK_IGNORES)
    die_with_parent(parent)
    rank = place.node_rank * local_world + local_rank
    for name in [n for n in os.environ if n.startswith(SCHEDULER_PREFIXES)]:
        del os.environ[name]  # else under SLURM every rank of a task takes SLURM_PROCID as its rank
    os.environ.update(
        MASTER_ADDR=place.master_addr, MASTER_PORT=str(place.master_port),
        WORLD_SIZE=str(local_world * place.num_nodes), NODE_RANK=str(place.node_rank),
        LOCAL_RANK=str(local_rank), RANK=str(rank),
    )  # fmt: skip
    if not torch.cuda.is_available():
        torch.set_num_threads(CPU_THREADS_PER_RANK)
    value = fn(*args)
    if rank == 0:  # a file, not a pipe: a pipe blocks the writer until read, after the join
        torch.save(value, out)


def spawn_ranks(
    fn: Callable[..., Any],
    world: int,
    *args: Any,
    place: NodePlace | None = None,
    abort: Callable[[], str | None] | None = None,
) -> Any:
    """Run ``fn(*args)`` in ``world`` new processes on this machine, and return what global rank 0
    returned (None on a machine other than node 0).

    Alone (``place`` None) they are ranks 0..world-1 of one job. With a ``place``, they are this
    machine's share of a job of ``place.num_nodes`` machines of ``world`` processes each: ranks
    ``node_rank * world + local_rank``, meeting at ``place.master_addr:master_port``.

    ``fn`` and ``args`` must pickle (a module-level function; configs, paths); ``fn`` builds its
    trainer with ``devices=world`` and ``num_nodes`` as in ``place`` (``TrainConfig``).
    ``abort``, asked every second while the ranks run, returns a reason to end them (another
    machine's ranks failed: ours would wait in a collective until its timeout).

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback in the message);
            the other ranks are ended.
        torch.multiprocessing.ProcessExitedException: a rank died (a signal, ``os._exit``).
        NodeFailed: ``abort`` gave a reason; the ranks were ended.
        ValueError: ``world`` below 1.

    Whatever ends the wait here (a failed rank, ``abort``, Ctrl-C) ends every rank first. The
    ranks ignore SIGINT, SIGTERM and SIGUSR2 (:data:`RANK_IGNORES`) and see none of a scheduler's
    ``SLURM_*`` variables: their places are the ones set here.
    """
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    place = place or NodePlace(0, 1, "127.0.0.1", free_port())
    with tempfile.TemporaryDirectory(prefix="ranks") as tmp:
        out = str(Path(tmp) / "rank0.pt")
        ranks = None
        try:
            with _blocked(RANK_IGNORES):
                ranks = mp.start_processes(
                    _rank_main,
                    args=(os.getpid(), world, place, fn, args, out),
                    nprocs=world,
                    join=False,
                    start_method="spawn",
                )
            # grace 0: a rank failed, the others wait in a collective and ignore SIGTERM; end them
            while not ranks.join(timeout=1.0, grace_period=0):
                if abort is not None and (why := abort()):
                    raise NodeFailed(why)
        except BaseException:  # NodeFailed, Ctrl-C, a failing ``abort``: leave no rank behind
            if ranks is not None:
                _end(ranks.processes)
            raise
        return torch.load(out, weights_only=False) if place.node_rank == 0 else None


def _end(processes: list[Any]) -> None:
    """SIGKILL and reap every process of ``processes`` still running."""
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join()


@contextlib.contextmanager
def _blocked(signals: tuple[int, ...]) -> Iterator[None]:
    """Block ``signals`` in this thread while inside: processes it starts inherit the block (over
    ``exec``) and keep it until :func:`_rank_main` ignores them, so no signal kills a rank in its
    seconds of interpreter start-up. Nothing is lost here: a signal for this process meanwhile
    goes to another thread's, or waits until the block ends, and reaches its handler.

    multiprocessing's resource tracker unblocks SIGINT and SIGTERM when it starts (on the first
    ``spawn``), so it is started first."""
    resource_tracker.ensure_running()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
