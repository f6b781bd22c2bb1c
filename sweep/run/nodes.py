"""One cell on several machines: the tasks of one cluster job train it together.

A cell with ``train.num_nodes: N`` is trained by a job of N nodes, one task per node
(``make sweep LAUNCHER=slurm``; ``submitit-local`` runs the N tasks on this machine). Task 0 is a
queue worker like any other and leads; tasks 1..N-1 follow (:func:`follow`). The leader opens a
``torch.distributed.TCPStore`` on node 0 at a port derived from the job id (:func:`store_port`:
every task computes the same one without talking). For each cell the leader writes the rank
function and its arguments (pickled: the cell, its run id, checkpoint paths) and a fresh
``MASTER_PORT`` under ``cell/<n>``; every follower reads it and starts its machine's ``devices``
ranks with ``NODE_RANK`` = its task (:func:`experiments.distributed.spawn_ranks`); Lightning then
joins all ``N x devices`` ranks in one DDP group at node 0. Global rank 0 (on node 0) records
the run, as in a one-machine cell.

A machine whose ranks fail writes ``failed/<n>`` (one line) and the other machines end theirs
rather than wait in a collective; the leader fails the cell and the queue hands it on. When the
leader's worker ends, it writes ``end`` and the followers leave. The store lives in the leader's
process: a requeued job (a new attempt) has a new one, so no follower replays an old cell.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

#: ``<num_nodes>|<node 0's address>|<store port>``: set by the job for the leader's worker.
NODES_ENV = "GATED_ATTN_NODES"
#: How long a follower waits for the leader's store, and any store call for an answer.
STORE_TIMEOUT_S = 600
#: How long the leader waits, at its end, for the followers to read ``end``.
LEAVE_WAIT_S = 60.0
POLL_S = 0.2


@dataclass(frozen=True)
class NodeGroup:
    """The machines of one job.

    Attributes:
        num_nodes: machines (tasks) in the job.
        master_addr: node 0's address (where the store and every cell's ranks meet).
        store_port: the store's port on node 0 (:func:`store_port`).
    """

    num_nodes: int
    master_addr: str
    store_port: int

    def to_env(self) -> str:
        return f"{self.num_nodes}|{self.master_addr}|{self.store_port}"

    @classmethod
    def from_env(cls) -> NodeGroup | None:
        """The group this process leads (``NODES_ENV``), or None outside a job of several nodes."""
        value = os.environ.get(NODES_ENV)
        if not value:
            return None
        nodes, addr, port = value.split("|")
        return cls(int(nodes), addr, int(port))


#: The store's ports: below Linux's ephemeral range (32768 and up), where the kernel picks the
#: ports of outgoing connections and of every cell's ``MASTER_PORT``.
STORE_PORTS = range(20000, 32768)


def store_port(job_id: str) -> int:
    """A port of :data:`STORE_PORTS` for job ``job_id``'s store: every task of the job finds the
    same one without talking."""
    return STORE_PORTS[int(hashlib.sha256(job_id.encode()).hexdigest(), 16) % len(STORE_PORTS)]


def _store(group: NodeGroup, leader: bool) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(
        group.master_addr,
        group.store_port,
        is_master=leader,
        timeout=timedelta(seconds=STORE_TIMEOUT_S),
        wait_for_workers=False,
    )


def _one_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[-1] if text else ''}"[:500]


class Leader:
    """Node 0's side, in the queue worker: the store, and each cell's ranks on this machine."""

    def __init__(self, group: NodeGroup) -> None:
        self.group = group
        self.store = _store(group, leader=True)
        self.cells = 0

    def train(
        self, fn: Callable[..., Any], devices: int, *args: Any, watch: Callable[[], None] | None = None
    ) -> Any:
        """Run ``fn(*args)`` as the cell's ``devices`` ranks of this machine, the followers running
        theirs; return what global rank 0 returned. ``watch`` is called every second meanwhile.

        Raises:
            experiments.distributed.NodeFailed: a follower's ranks failed (its line).
            torch.multiprocessing.ProcessRaisedException: a rank here raised (the followers are
                told, and end theirs).
        """
        from experiments.distributed import NodePlace, free_port, spawn_ranks

        n = self.cells
        self.cells += 1
        port = free_port()
        self.store.set(f"cell/{n}", pickle.dumps((fn, args, devices, port)))
        place = NodePlace(0, self.group.num_nodes, self.group.master_addr, port)
        try:

            def abort() -> str | None:
                if watch is not None:
                    watch()
                return _failed(self.store, n)

            return spawn_ranks(fn, devices, *args, place=place, abort=abort)
        except BaseException as err:  # Ctrl-C too: the followers' ranks must not wait on ours
            with contextlib.suppress(RuntimeError):
                self.store.set(f"failed/{n}", f"node 0: {_one_line(err)}")
            raise

    def close(self) -> None:
        """Tell the followers to leave, and give them a moment to read it."""
        self.store.set("end", b"1")
        deadline = time.monotonic() + LEAVE_WAIT_S
        while self.store.add("left", 0) < self.group.num_nodes - 1 and time.monotonic() < deadline:
            time.sleep(POLL_S)


_leader: Leader | None = None


@contextlib.contextmanager
def leading() -> Iterator[Leader | None]:
    """In a queue worker: lead the group of ``NODES_ENV`` while inside (None outside such a job)."""
    global _leader
    group = NodeGroup.from_env()
    if group is None:
        yield None
        return
    _leader = Leader(group)
    try:
        yield _leader
    finally:
        _leader.close()
        _leader = None


def leader_for(num_nodes: int) -> Leader:
    """The leader of this process's job, for a cell of ``num_nodes`` machines.

    Raises:
        RuntimeError: this process leads no job of ``num_nodes`` nodes (the sweep's
            ``check_runnable`` refuses such a grid up front; this is the last guard).
    """
    if _leader is None or _leader.group.num_nodes != num_nodes:
        have = _leader.group.num_nodes if _leader else 1
        raise RuntimeError(f"a cell of {num_nodes} nodes in a worker of {have}: run it with LAUNCHER=slurm")
    return _leader


def _failed(store: Any, n: int) -> str | None:
    """The line of a machine whose ranks of cell ``n`` failed; a store gone means node 0 is."""
    try:
        return store.get(f"failed/{n}").decode() if store.check([f"failed/{n}"]) else None
    except RuntimeError:  # the connection to node 0 is lost
        return "node 0 is gone"


def follow(group: NodeGroup, node_rank: int, out: Callable[[str], None] = print) -> int:
    """A follower task's life: train its machine's ranks of each cell the leader announces, until
    ``end``. Returns 0, or 1 when node 0's store never answered (:data:`STORE_TIMEOUT_S`) or went
    away without saying ``end``. A cell that fails here (its full traceback in ``out``) is
    told to the leader in one line, and this task waits for the next."""
    from experiments.distributed import NodePlace, spawn_ranks

    try:
        store = _store(group, leader=False)
    except RuntimeError as err:  # torch's DistStoreError after STORE_TIMEOUT_S of retries
        where = f"{group.master_addr}:{group.store_port}"
        out(f"node {node_rank}: no leader's store at {where} after {STORE_TIMEOUT_S} s ({_one_line(err)})")
        return 1
    n = 0
    try:
        while True:
            if store.check([f"cell/{n}"]):
                announced = store.get(f"cell/{n}")
                try:  # an import error unpickling the cell fails it like any other
                    fn, args, devices, port = pickle.loads(announced)
                    place = NodePlace(node_rank, group.num_nodes, group.master_addr, port)
                    out(f"node {node_rank}: cell {n} on {devices} ranks")
                    spawn_ranks(fn, devices, *args, place=place, abort=lambda n=n: _failed(store, n))
                except BaseException as err:  # told to the leader, which fails the cell
                    line = f"node {node_rank}: {_one_line(err)}"
                    out(f"node {node_rank}: cell {n} failed\n{''.join(traceback.format_exception(err))}")
                    with contextlib.suppress(RuntimeError):
                        store.set(f"failed/{n}", line)
                    if not isinstance(err, Exception):  # Ctrl-C, SystemExit: this task ends
                        raise
                n += 1
            elif store.check(["end"]):
                if not store.check([f"cell/{n}"]):  # announced just before the end: train it first
                    store.add("left", 1)
                    return 0
            else:
                time.sleep(POLL_S)
    except RuntimeError as err:  # the store went away: node 0 is gone
        out(f"node {node_rank}: node 0 is gone ({_one_line(err)})")
        return 1
