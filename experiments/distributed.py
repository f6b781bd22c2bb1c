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

Every rank runs the whole recipe (fit, the last validation, the probes: their MoE forwards
all-reduce, so every rank must take part); rank 0 alone writes checkpoint files and logs.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

#: Threads per rank on CPU: the ranks already share the machine's cores.
CPU_THREADS_PER_RANK = 1


def free_port() -> int:
    """A TCP port on localhost that nothing listens on now (the rendezvous of the ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when the process that started it dies (Linux's
    ``PR_SET_PDEATHSIG``; elsewhere nothing): a sweep worker killed with ``kill -9`` leaves no rank
    training on, and writing into its run, behind it."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before the line above: nothing would signal us
            os._exit(1)


def _rank_main(
    local_rank: int, parent: int, world: int, port: int, fn: Callable[..., Any], args: tuple, out: str
) -> None:
    die_with_parent(parent)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), NODE_RANK="0",
        LOCAL_RANK=str(local_rank), RANK=str(local_rank),
    )  # fmt: skip
    if not torch.cuda.is_available():
        torch.set_num_threads(CPU_THREADS_PER_RANK)
    value = fn(*args)
    if local_rank == 0:  # a file, not a pipe: a pipe blocks the writer until read, after the join
        torch.save(value, out)


def spawn_ranks(fn: Callable[..., Any], world: int, *args: Any) -> Any:
    """Run ``fn(*args)`` in ``world`` new processes, ranks 0..world-1 of one job on this machine,
    and return what rank 0 returned.

    ``fn`` and ``args`` must pickle (a module-level function; configs, paths); ``fn`` builds its
    trainer with ``devices=world`` (``TrainConfig.devices``, ``num_nodes=1``).

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback in the message);
            the other ranks are ended.
        torch.multiprocessing.ProcessExitedException: a rank died (a signal, ``os._exit``).
        ValueError: ``world`` below 1.
    """
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    with tempfile.TemporaryDirectory(prefix="ranks") as tmp:
        out = str(Path(tmp) / "rank0.pt")
        mp.start_processes(
            _rank_main,
            args=(os.getpid(), world, free_port(), fn, args, out),
            nprocs=world,
            join=True,
            start_method="spawn",
        )
        return torch.load(out, weights_only=False)
