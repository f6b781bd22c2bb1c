"""Training-state checkpoints of a sharded run: a folder of shards (torch distributed checkpoint),
written under the rules a one-file checkpoint keeps (``experiments.checkpointing``).

``step000120.ckpt/`` holds one ``__<rank>_0.distcp`` file of every rank's shards (weights and
AdamW state), DCP's ``.metadata`` and Lightning's ``meta.pt`` (loops, the spike detector, the RNG
states: the rest of the training state). The rules:

- **Atomic.** The ranks write ``step000120.ckpt.tmp/``; once all have, rank 0 writes the record
  and renames the folder into place. A rank killed mid-write leaves the previous checkpoint whole
  and a ``.tmp`` folder nobody reads (the next resume removes it).
- **Checksums.** Each rank hashes the files it wrote (in parallel); rank 0 records every file's
  size and sha256 in ``step000120.ckpt.sha256`` before the rename, and
  :func:`folder_problem` checks them before a resume.
- **Resharding.** DCP stores each tensor with its global shape, so the folder loads on any number
  of ranks (``tests/test_fsdp.py`` resumes a two-rank checkpoint on one rank); the sweep still
  refuses to resume a cell with another placement (``sweep.run.placement``), whose sums would run
  in another order.

The finished run's ``final.ckpt`` is one file, gathered on rank 0
(:meth:`experiments.sharding.ShardedStrategy.full_weights`), so scoring and export read it as they
read a one-process run's.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from experiments.checksums import file_sha256

#: Lightning's file of the non-tensor training state inside a sharded checkpoint.
METADATA = "meta.pt"


def save_sharded(strategy: Any, checkpoint: dict[str, Any], filepath: Any) -> None:
    """Write ``checkpoint`` (Lightning's, its ``state_dict`` and ``optimizer_states`` sharded) as
    the folder ``filepath``, atomically and with its record; every rank calls it.

    A folder already there (rank 0's view decides for all) is the state of this same step's
    start, saved before (a run stopped at the step it resumed from): it is kept, not rewritten.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    path = Path(strategy.broadcast(str(filepath)))
    if strategy.broadcast(path.exists()):
        return
    tmp = path.with_name(path.name + ".tmp")
    if strategy.is_global_zero:
        shutil.rmtree(tmp, ignore_errors=True)  # a save killed midway, before
        tmp.mkdir(parents=True)
    strategy.barrier("sharded-checkpoint-start")
    state = {"state_dict": checkpoint.pop("state_dict")}
    for i, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
        state[f"optimizer_{i}"] = optim_state
    dcp_save(state, storage_writer=FileSystemWriter(tmp, sync_files=True))
    if strategy.is_global_zero:
        with open(tmp / METADATA, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
    strategy.barrier("sharded-checkpoint-written")
    records = _gather(_own_records(tmp, strategy.global_rank))
    if strategy.is_global_zero:
        files = {name: r for part in records for name, r in part.items()}
        sums = sum_path(path)
        sums_tmp = sums.with_name(sums.name + ".tmp")
        sums_tmp.write_text(json.dumps({"files": files}, sort_keys=True) + "\n")
        # The record first, as for one file: a kill between the renames leaves a record
        # without its folder, never a folder with another one's record.
        os.replace(sums_tmp, sums)
        os.replace(tmp, path)
    strategy.barrier("sharded-checkpoint-done")


def _own_records(folder: Path, rank: int) -> dict[str, dict[str, int | str]]:
    """Size and sha256 of the files rank ``rank`` wrote into ``folder``: its ``__<rank>_*``
    shards; rank 0 also the metadata files."""
    names = [p.name for p in folder.iterdir() if p.name.startswith(f"__{rank}_")]
    if rank == 0:
        names += [p.name for p in folder.iterdir() if not p.name.startswith("__")]
    return {
        n: {"bytes": (folder / n).stat().st_size, "sha256": file_sha256(folder / n)} for n in sorted(names)
    }


def _gather(record: dict) -> list[dict]:
    if not (dist.is_available() and dist.is_initialized()):
        return [record]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, record)
    return out


def sum_path(path: Path) -> Path:
    """The record beside checkpoint ``path``: ``<path>.sha256`` (as for a one-file checkpoint)."""
    return path.with_name(path.name + ".sha256")


def folder_problem(path: Path) -> str | None:
    """Why the sharded checkpoint folder ``path`` cannot be trusted, in words, or None when every
    file its record names is there with its size and sha256 and no file is unaccounted for."""
    try:
        record = json.loads(sum_path(path).read_text())["files"]
    except FileNotFoundError:
        return f"a folder without its record {sum_path(path).name}"
    except (ValueError, KeyError, TypeError):
        return f"its record {sum_path(path).name} cannot be read"
    try:
        present = sorted(p.name for p in path.iterdir())
        if present != sorted(record):
            missing, extra = set(record) - set(present), set(present) - set(record)
            return f"a folder of other files than written (missing {sorted(missing)}, extra {sorted(extra)})"
        for name, r in record.items():
            size = (path / name).stat().st_size
            if size != r.get("bytes"):
                return f"{name}: {size:,} bytes, {r.get('bytes')} when written"
            if file_sha256(path / name) != r.get("sha256"):
                return f"{name} changed since it was written (another sha256)"
    except OSError as err:
        return err.strerror or type(err).__name__
    return None
