"""Ctrl-C and SIGTERM: finish the current step, save a checkpoint, mark the run KILLED, stop.

:class:`StopRequest` replaces the SIGINT and SIGTERM handlers for the length of a sweep; the
first signal only sets a flag. :class:`StopOnRequest`, a Lightning callback, sees the flag before
the next training step, saves the training state as ``step<N>.ckpt`` and raises
:class:`Interrupted`; the runner marks the run KILLED and the sweep stops. A second Ctrl-C
raises ``KeyboardInterrupt`` at once (the run then resumes from its last periodic checkpoint).
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType

import lightning.pytorch as pl

from experiments.checkpointing import save_at_step_start, step_checkpoint_name

EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # the shell's 128 + signal number


class Interrupted(Exception):
    """Training stopped on a signal at the start of ``step``; the state is saved in ``checkpoint``."""

    def __init__(self, signum: int, step: int, checkpoint: Path) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        super().__init__(f"{signal.Signals(signum).name} at step {step}; saved {checkpoint}")


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
    ``folder/step<N>.ckpt`` and raise :class:`Interrupted`."""

    def __init__(self, request: StopRequest, folder: Path) -> None:
        self.request, self.folder = request, folder

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.request.reclaim()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.request.reclaim()  # the final trainer.validate() registers Lightning's handler again

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        # At a step's start, as PeriodicCheckpoint: the step before has logged everything.
        if self.request.signum is None:
            return
        path = self.folder / step_checkpoint_name(trainer.global_step)
        save_at_step_start(trainer, path)
        raise Interrupted(self.request.signum, trainer.global_step, path)
