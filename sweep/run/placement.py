"""Which machines a grid's cells may train on here: the sweep's check before anything starts, and
whether an unfinished run may resume with the placement a cell has now."""

from __future__ import annotations

import os
from typing import Any

from experiments import names as N
from experiments.config import TrainConfig
from experiments.devices import auto_precision
from experiments.memory import memory_problem
from sweep.grid import Cell, Grid
from sweep.gridfile import GridError

#: The machines of a queue worker's cluster job, set by the cluster launcher (1 when unset).
NODES_ENV = "GATED_ATTN_NODES"


def job_nodes() -> int:
    """How many machines this worker's job holds (:data:`NODES_ENV`; 1 outside a cluster job)."""
    return int(os.environ.get(NODES_ENV, "1"))


def check_runnable(grid: Grid, cells: list[Cell], nodes: int | None = 1) -> None:
    """The cells' machines against what trains them: a cell of ``train.num_nodes`` > 1 needs a
    worker in a cluster job of that many nodes (its ranks start there with ``srun torchrun``,
    :mod:`sweep.run.ranks`); ``nodes`` is how many this process's job has (1: one machine, see
    :func:`job_nodes`), or None for a driver that submits cluster jobs
    (it sizes them from the cells, so they must all agree). DDP and FSDP train on any number of
    devices (CPU ranks too). A row with ``train.gpu_memory_gib`` whose estimated peak a GPU
    (``experiments.memory``) exceeds it is refused.

    Raises:
        GridError: naming the row and the field (``train.num_nodes``, ``train.gpu_memory_gib``).
    """
    first = next((c for c in cells if c.config.train.num_nodes > 1), None)
    for cell in cells:
        if found := _problem(cell, first, nodes):
            raise GridError(grid.file, found[0], cell.row.id, found[1])


def _problem(cell: Cell, first: Cell | None, nodes: int | None) -> tuple[str, str] | None:
    """(why, the field) of :func:`check_runnable`'s first objection to ``cell``, or None."""
    t = cell.config.train
    if why := memory_problem(cell.config):
        return why, "train.gpu_memory_gib"
    if nodes is None and first is not None and t.num_nodes != first.config.train.num_nodes:
        return (
            f"num_nodes = {t.num_nodes}, but row '{first.row.id}' has {first.config.train.num_nodes}: "
            "a sweep's cluster jobs have one size; sweep them apart (ROWS=)"
        ), "train.num_nodes"
    if nodes is not None and t.num_nodes > 1 and t.num_nodes != nodes:
        return (
            f"num_nodes = {t.num_nodes}: a cell on several machines trains in a cluster job of as "
            "many nodes (LAUNCHER=slurm, or submitit-local to try it here)"
        ), "train.num_nodes"
    return None


def placement_change(run: Any, cell: Cell) -> str:
    """Why the unfinished ``run`` cannot resume with the ``cell``'s placement (``TrainConfig.PLACEMENT``:
    devices, nodes, strategy, micro-batches, compile; and the precision ``auto`` resolves to on this
    machine), or "" when it has the same. Another split of the
    batch sums in another order and replays its steps differently, so the resumed cell would end
    with other numbers than one that never stopped."""
    params, train = run.data.params, cell.config.train
    moved = [
        f"train.{key} {params[f'train.{key}']} -> {getattr(train, key)}"
        for key in TrainConfig.PLACEMENT
        if key != "gpu_memory_gib"  # a budget the plan is checked against, not how a step is summed
        and f"train.{key}" in params
        and params[f"train.{key}"] != str(getattr(train, key))
    ]
    had, has = run.data.tags.get(N.PRECISION_TAG), auto_precision(train.precision)
    if had is not None and had != has:  # `auto` resolves by machine: fp32 here, bf16 on a GPU
        moved.append(f"precision {had} -> {has}")
    if not moved:
        return ""
    run_id = run.info.run_id
    return (
        f"its unfinished run {run_id} trained with another placement ({', '.join(moved)}), and resuming "
        f"it so would change its numbers; resume it with the placement it had, or delete run {run_id} "
        f"(mlflow runs delete --run-id {run_id}) to train the cell anew"
    )
