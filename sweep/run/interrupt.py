"""Ctrl-C and SIGTERM: finish the current step, save a checkpoint, mark the run KILLED, stop.

:class:`StopRequest` replaces the SIGINT and SIGTERM handlers for the length of a sweep; the
first signal only sets a flag. :class:`StopOnRequest`, a Lightning callback, sees the flag before
the next training step, saves the training state as ``step<N>.ckpt`` and raises
:class:`Interrupted`; the runner marks the run KILLED and the sweep stops. A second Ctrl-C
raises ``KeyboardInterrupt`` at once (the run then resumes from its last periodic checkpoint).

A cell in several processes (DDP) is stopped the same way: the sweep's process writes the signal
into the cell's checkpoint folder (:data:`STOP_FILE`), and each rank's :class:`StopOnRequest`
reads it through a :class:`StopFlag`; the ranks agree on the step, save, and return
:class:`Interrupted` to the sweep.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType

import lightning.pytorch as pl
import torch

from experiments.checkpointing import save_at_step_start, step_checkpoint_name

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # the shell's 128 + signal number


#: In a multi-process cell's checkpoint folder: the sweep's signal number, for its ranks to read.
STOP_FILE = ".stop"


class Interrupted(Exception):
    """Training stopped on a signal at the start of ``step``; the state is saved in ``checkpoint``."""

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"{signal.Signals(signum).name} at step {step}; saved {checkpoint}")

    def __reduce__(self) -> tuple:  # a rank returns it to the sweep's process, pickled
        return (Interrupted, (self.signum, self.step, self.checkpoint))


def ignore_signals() -> None:
    """SIGINT and SIGTERM do nothing in this process (a rank: its sweep's process decides)."""
    if threading.current_thread() is threading.main_thread():
        for sig in EXIT_CODES:
            signal.signal(sig, signal.SIG_IGN)


class StopFlag:
    """A rank's view of its sweep's :class:`StopRequest`, for :class:`StopOnRequest`: the sweep's
    process writes the signal's number into ``path`` (:func:`raise_flag`); the rank itself
    ignores SIGINT and SIGTERM, which a terminal or SLURM sends to every process."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def signum(self) -> int | None:
        try:
            return int(self.path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def reclaim(self) -> None:
        ignore_signals()  # Lightning installs its SIGTERM handler when fit starts


def raise_flag(request: StopRequest | None, path: Path) -> None:
    """Once ``request`` holds a signal, write it to ``path`` for the ranks (:class:`StopFlag`)."""
    if request is None or request.signum is None or path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(str(request.signum))
    tmp.replace(path)


class StopRequest:
    """Catches SIGINT and SIGTERM while active (a context manager); ``signum`` is the first one
    received, or None. Outside the main thread it installs nothing (Python allows handlers only
    there) and never fires.

    Until :meth:`arm` is called (the sweep calls it once the corpus is built and the store is
    open, when there is a cell to save), Ctrl-C raises ``KeyboardInterrupt`` at once: nothing
    is half-done then, and a long corpus build should not need a second Ctrl-C."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.armed = False
        self._previous: dict[int, object] = {}

    def arm(self) -> None:
        """From now on a first signal only sets :attr:`signum`."""
        self.armed = True

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in EXIT_CODES:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def reclaim(self) -> None:
        """Reinstall our handlers (Lightning installs its own SIGTERM handler when ``fit`` starts;
        it would stop the run inside validation, without a checkpoint)."""
        for sig in self._previous:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        if signum == signal.SIGINT and (not first or not self.armed):
            raise KeyboardInterrupt  # before training, or a second Ctrl-C: stop now

    @property
    def exit_code(self) -> int:
        """130 after SIGINT, 143 after SIGTERM, 0 when no signal came."""
        return EXIT_CODES.get(self.signum, 0) if self.signum else 0


class StopOnRequest(pl.Callback):
    """Before each training step: if ``request`` holds a signal, save the full training state to
    ``folder/step<N>.ckpt`` and raise :class:`Interrupted`. Under DDP every rank stops at the
    same step (any rank's signal stops all: the others would wait in the step's all-reduce).

    Args:
        request: a :class:`StopRequest`, or a rank's :class:`StopFlag`.
        folder: the cell's checkpoint folder.
    """

    def __init__(self, request: StopRequest | StopFlag, folder: Path) -> None:
        self.request, self.folder = request, folder

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.request.reclaim()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.request.reclaim()  # the final trainer.validate() registers Lightning's handler again

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: object, batch_idx: int
    ) -> None:
        # At a step's start, as PeriodicCheckpoint: the step before has logged everything. Not
        # between a step's micro-batches: their gradients would be lost, the resume misaligned.
        if batch_idx % trainer.accumulate_grad_batches:
            return
        signum = self.request.signum or 0
        if trainer.world_size > 1:  # an all-reduce of one number a step: the signal any rank saw
            seen = torch.tensor(signum, device=trainer.strategy.root_device)
            signum = int(trainer.strategy.reduce(seen, reduce_op="max"))
        if not signum:
            return
        path = self.folder / step_checkpoint_name(trainer.global_step)
        save_at_step_start(trainer, path)
        raise Interrupted(signum, trainer.global_step, path)
