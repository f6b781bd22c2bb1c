"""Which GPUs each local worker of a sweep trains on.

``WORKERS=auto`` on a machine with GPUs starts one worker per GPU (per ``devices`` GPUs for cells
that train on several), times ``CELLS_PER_GPU`` where memory allows several cells on one card
(``make gpu-check`` measures a ``small`` cell's peak memory, alone and packed). Each worker sees
only its own GPUs through ``CUDA_VISIBLE_DEVICES``, so every cell's ``cuda:0`` is its own card
and Lightning's ``devices: N`` takes the worker's N. Workers are spread over the GPUs first:
worker ``i`` gets slot ``i mod slots``, so two workers share a card only when there are more
workers than GPUs.
SLURM jobs (``LAUNCHER=slurm``) keep the GPUs SLURM gives them; nothing here applies to them.
"""

from __future__ import annotations

import os
from typing import Any

#: The environment variable that restricts a process to some GPUs (CUDA's own).
VISIBLE = "CUDA_VISIBLE_DEVICES"


class GpuLayoutError(ValueError):
    """The cells need more GPUs per worker than this machine shows."""


def usable_cores() -> int:
    """CPU cores this process may run on: its affinity (``taskset``, a container's or a SLURM
    job's cpuset), not the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def cuda_entries(named: str) -> list[str]:
    """The entries of a ``CUDA_VISIBLE_DEVICES`` value that CUDA reads: in order, up to the first
    invalid one, which CUDA ignores with every entry after it (``0,-1,2`` shows GPU 0 only). An
    entry is valid as a non-negative index or a ``GPU-``/``MIG-`` UUID."""
    entries = []
    for entry in (e.strip() for e in named.split(",")):
        if not (entry.isdigit() or entry.startswith(("GPU-", "MIG-"))):
            break
        entries.append(entry)
    return entries


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` names them (the entries CUDA
    reads, :func:`cuda_entries`, as many as torch counts), else ``0 .. n-1``; [] where torch sees
    no CUDA device, whatever the variable says (a CPU machine with ``CUDA_VISIBLE_DEVICES=0``)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        return []
    named = os.environ.get(VISIBLE)
    return [str(i) for i in range(count)] if named is None else cuda_entries(named)[:count]


def auto_workers(devices_per_cell: int, cells_per_gpu: int, gpus: list[str] | None = None) -> int:
    """``WORKERS=auto``: on a GPU machine, ``cells_per_gpu`` workers per group of
    ``devices_per_cell`` GPUs; elsewhere one single-threaded worker per usable CPU core
    (:func:`usable_cores`; the fastest way measured on 2 cores)."""
    gpus = visible_gpus() if gpus is None else gpus
    if not gpus:
        return usable_cores()
    return max(1, len(gpus) // devices_per_cell) * cells_per_gpu


def worker_environments(
    count: int, devices_per_cell: int, cells_per_gpu: int, gpus: list[str] | None = None
) -> list[dict[str, str]]:
    """The ``CUDA_VISIBLE_DEVICES`` of each of ``count`` workers: worker ``i`` gets group
    ``i mod groups`` of ``devices_per_cell`` GPUs (module docstring); ``cells_per_gpu`` only
    says how many are meant to share a group. Empty dicts on a machine without GPUs.

    Raises:
        GpuLayoutError: a cell needs more GPUs than the machine shows.
    """
    gpus = visible_gpus() if gpus is None else gpus
    if not gpus:
        return [{} for _ in range(count)]
    groups = [gpus[i : i + devices_per_cell] for i in range(0, len(gpus), devices_per_cell)]
    groups = [g for g in groups if len(g) == devices_per_cell]
    if not groups:
        raise GpuLayoutError(
            f"a cell trains on train.devices = {devices_per_cell} GPUs, but this machine shows "
            f"{len(gpus)} ({VISIBLE}={','.join(gpus)})"
        )
    return [{VISIBLE: ",".join(groups[i % len(groups)])} for i in range(count)]


def sweep_workers(requested: int | None, cells: list[Any], cells_per_gpu: int, local: bool) -> int:
    """The sweep's worker count: ``requested``, or for ``auto`` (None) :func:`auto_workers` for
    the widest of ``cells`` (``train.devices``); for ``local`` workers, first checks that the
    machine has the GPUs they need, so a refusal comes before anything is enqueued.

    Raises:
        GpuLayoutError: a cell needs more GPUs than the machine shows.
    """
    devices = max(c.config.train.devices for c in cells)
    workers = auto_workers(devices, cells_per_gpu) if requested is None else requested
    if local:
        worker_environments(workers, devices, cells_per_gpu)
    return workers
