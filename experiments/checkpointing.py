"""Training-state checkpoints a run can resume from: crash-safe files, saved at a step's start.

A run's training state (model, optimiser, LR scheduler, loop progress, RNG states, spike detector,
last validation; the data position is the step) is saved as ``step<N>.ckpt`` every
``train.checkpoint_every`` steps, the one before removed. Restarting ``trainer.fit`` from the
newest file continues the run as if it had never stopped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from experiments.checksums import file_sha256

try:
    import resource
except ImportError:  # not on Windows
    resource = None

FINAL_CHECKPOINT = "final.ckpt"  # the finished run's weights, for evaluation
_STEP_FILE = re.compile(r"^step(\d+)\.ckpt$")
SUM_SUFFIX = ".sha256"  # beside each checkpoint: {"bytes": size, "sha256": hex} of the file as written


class CheckpointDamaged(RuntimeError):
    """A checkpoint whose bytes are not the ones written (cut short, grown, overwritten), one line
    naming the file; its run's cell must be trained again to have it back."""


def sum_file(path: Path) -> Path:
    """The content record of checkpoint ``path``: ``<path>.sha256``."""
    return path.with_name(path.name + SUM_SUFFIX)


def checkpoint_problem(path: Path) -> str | None:
    """Why checkpoint ``path`` cannot be trusted, in words, or None when it is whole.

    A checkpoint written by :class:`AtomicCheckpointIO` has its size and sha256 beside it
    (:func:`sum_file`), checked here (reading the file once: about 10 ms for a `tiny` one). One
    written before the record existed is checked as a whole zip archive (what ``torch.save`` writes)
    only: a truncated file is found, a same-sized overwrite is not. A sharded run's checkpoint is
    a folder, each of its files checked against its record
    (:func:`experiments.sharded_checkpoints.folder_problem`).
    """
    if path.is_dir():
        from experiments.sharded_checkpoints import folder_problem

        return folder_problem(path)
    try:
        size = path.stat().st_size
        if size == 0:
            return "an empty file"
        try:
            record = json.loads(sum_file(path).read_text())
        except FileNotFoundError:
            return None if zipfile.is_zipfile(path) else "not a whole torch archive (truncated?)"
        except ValueError:
            return f"its record {sum_file(path).name} cannot be read"
        if size != record.get("bytes"):
            return f"{size:,} bytes, {record.get('bytes')} when written"
        if file_sha256(path) != record.get("sha256"):
            return "changed since it was written (another sha256)"
        return None
    except OSError as err:
        return err.strerror or type(err).__name__


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """The ``state_dict`` of a weights file (:data:`FINAL_CHECKPOINT`, ``LMModule``'s keys under
    ``model.``), after its content check, on the CPU.

    Raises:
        FileNotFoundError: no such file.
        CheckpointDamaged: its bytes are not the ones written, or not a weights file; one line
            naming the file.
    """
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    if problem := checkpoint_problem(path):
        raise CheckpointDamaged(
            f"checkpoint {path} is {problem}: not used; train its cell again (FORCE=1 with its row in ROWS)"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    except Exception as err:  # whole by its record, yet not a weights file torch can read
        detail = (str(err).strip().splitlines() or [""])[0][:200]
        raise CheckpointDamaged(
            f"checkpoint {path} cannot be read as weights ({type(err).__name__}: {detail}); "
            "train its cell again (FORCE=1 with its row in ROWS)"
        ) from None


def step_checkpoint_name(step: int) -> str:
    """``step000120.ckpt``: periodic and interrupt checkpoints share the name, so the newest sorts last."""
    return f"step{step:06d}.ckpt"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes ``<path>.tmp`` in the same folder, then renames it over ``path``: a process killed
    mid-write (``kill -9``, a dead machine) leaves the previous checkpoint intact, never a
    truncated one."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Raises:
        CheckpointWriteError: the file could not be written (disk full, file-size limit); the
            partial ``.tmp`` is removed and the previous checkpoint stays.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        sum_tmp = tmp.with_name(tmp.name + SUM_SUFFIX)
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            record = {"bytes": tmp.stat().st_size, "sha256": file_sha256(tmp)}
            sum_tmp.write_text(json.dumps(record) + "\n")
        except Exception as err:  # torch reports a short write as RuntimeError("... unexpected pos ...")
            written = tmp.stat().st_size if tmp.exists() else 0
            tmp.unlink(missing_ok=True)
            sum_tmp.unlink(missing_ok=True)
            raise CheckpointWriteError(path, written, err) from err
        except BaseException:  # Ctrl-C mid-write: no partial file either
            tmp.unlink(missing_ok=True)
            sum_tmp.unlink(missing_ok=True)
            raise
        # The record first: a kill between the two renames leaves a record without its file
        # (checkpoint names are never reused), never a file with another file's record.
        os.replace(sum_tmp, sum_file(path))
        os.replace(tmp, path)


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written, with the likely reason in words: the file-size
    limit (``ulimit -f``) or a full disk, which torch reports only as ``unexpected pos``.

    Args:
        path: the checkpoint that was being written.
        written: bytes written before the failure.
        err: what the write raised.
    """

    def __init__(self, path: Path, written: int, err: BaseException) -> None:
        detail = (str(err).strip().splitlines() or [""])[0][:200]
        super().__init__(
            f"checkpoint {path.name} not written: {write_failure_reason(path.parent, written)} "
            f"({type(err).__name__}: {detail})"
        )


def write_failure_reason(folder: Path, written: int) -> str:
    """Why a write into ``folder`` that stopped after ``written`` bytes most likely failed."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0] if resource else -1
    if limit not in (-1, getattr(resource, "RLIM_INFINITY", -1)) and written >= limit - (1 << 20):
        return f"file too large: the file-size limit (ulimit -f) is {limit / 2**20:.1f} MiB"
    free = shutil.disk_usage(folder).free
    if free < max(written, 1 << 20) + (64 << 20):
        return f"disk full: {free / 2**20:.1f} MiB free in {folder}"
    return "write failed"


class PeriodicCheckpoint(pl.Callback):
    """Saves the training state as ``folder/step<N>.ckpt`` every ``every`` optimiser steps and
    removes the one before.

    It saves at the *start* of step ``N`` (``trainer.global_step == N``), not at the end of step
    ``N - 1`` as Lightning's ``ModelCheckpoint`` does: by then step ``N - 1`` has logged its metrics
    and run its validation, so a process killed just after the save loses no logged point, and the
    resumed run neither repeats nor skips a validation.

    Raises:
        ValueError: ``every`` below 1.
    """

    def __init__(self, folder: Path, every: int) -> None:
        if every < 1:
            raise ValueError(f"checkpoint interval must be at least 1 step, got {every}")
        self.folder, self.every = folder, every

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        if step == 0 or step % self.every:
            return
        path = self.folder / step_checkpoint_name(step)
        # Rank 0's view of the folder decides for every rank: all must enter the save together.
        if trainer.strategy.broadcast(path.exists()):  # the checkpoint this run resumed from
            return
        previous = latest_checkpoint(self.folder)
        save_at_step_start(trainer, path)
        if trainer.is_global_zero and previous is not None and previous != path:
            remove_checkpoint(previous)


def save_at_step_start(trainer: pl.Trainer, path: Path) -> None:
    """Save the full training state at the start of step ``trainer.global_step``.

    Lightning's restore assumes a save at the end of a step (``ModelCheckpoint``) and, for any
    other point, adds one to the logger's step counter (``_batches_that_stepped``; see
    ``_TrainingEpochLoop.reset``). Saved here, before the step begins, that counter is already
    right, so the file stores it one lower; ``tests/test_resume.py`` checks the resumed run logs
    every step once. Every rank calls it (Lightning's rule: a sharded strategy gathers the state);
    the ranks hold the same replica under DDP, and rank 0 writes it for all; under FSDP each rank
    writes its shards into one folder (``experiments.sharded_checkpoints``).
    """
    checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
    epoch_loop = checkpoint["loops"]["fit_loop"]["epoch_loop.state_dict"]
    epoch_loop["_batches_that_stepped"] -= 1
    trainer.strategy.save_checkpoint(checkpoint, path)  # under DDP, rank 0 writes the file
    trainer.strategy.barrier("step-checkpoint")  # no rank goes on before the file is there


def remove_checkpoint(path: Path) -> None:
    """Remove checkpoint ``path`` (a file, or a sharded run's folder) and its record."""
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
    sum_file(path).unlink(missing_ok=True)


def drop_step_checkpoints(folder: Path) -> None:
    """Remove the training-state files and folders (with their records and any ``.tmp``) once a
    run has its result recorded."""
    for path in folder.glob("step*.ckpt*"):
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def latest_checkpoint(folder: Path) -> Path | None:
    """The resumable checkpoint with the highest step in ``folder`` (``step<N>.ckpt``), or None."""
    found = [(int(m.group(1)), p) for p in folder.glob("step*.ckpt") if (m := _STEP_FILE.match(p.name))]
    return max(found)[1] if found else None
