"""Every signal the harness handles, in one module: which, who handles it, and what it does.

The set:

- **SIGINT** (Ctrl-C) and **SIGTERM** (``kill``, ``timeout``, SLURM's cancel and pre-emption):
  stop, saved. While a cell trains the first one only sets a flag (:class:`StopRequest`); every
  process of the cell stops at the start of the same step (:class:`StopOnRequest`), saves that
  step's training state as ``step<N>.ckpt``, and the run is marked ``killed``; the sweep exits
  130 / 143 and the same command resumes it. A second Ctrl-C stops at once (the run resumes from
  its last periodic checkpoint). Outside training (loading, scoring, writing tables) the first
  one unwinds (:func:`unwinding`): nothing is half-written, exit 130 / 143. While a report is
  published both wait (:func:`held`).
- **SIGUSR2**: submitit's warning before a time limit or pre-emption, sent to a job. The job's
  own process hears it (submitit calls ``WorkerJob.checkpoint``, which stops the worker with
  SIGTERM); workers and ranks ignore it (:func:`child_preexec`), as its default action would
  kill them unsaved.
- **The death of a parent** (``kill -9``, the OOM killer): its children get SIGTERM from the
  kernel (:func:`die_with_parent`, Linux's ``PR_SET_PDEATHSIG``), so a worker whose driver died,
  or torchrun whose worker died, saves its cell and leaves instead of training on orphaned.

Who gets a signal: a terminal's Ctrl-C reaches every process of its foreground group (driver,
workers, torchrun, ranks); SLURM signals every process of a job. Each process handles it as
above; a parent also forwards SIGTERM to its children (:func:`wait_forwarding`), for a signal sent
to it alone. Ranks of a multi-process cell handle SIGINT and SIGTERM like one process, and agree
on the stop step with one all-reduce (``sweep.run.cell.StopOnRequest``), so any rank's signal
stops them all at one step. This module imports no torch: the CLI installs it first thing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType

#: The signals that stop a sweep, saved; the exit status after each (the shell's 128 + number).
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
#: submitit's warning signal: the job's process acts on it, its workers and ranks ignore it.
PREEMPTION = signal.SIGUSR2


class Interrupted(Exception):
    """Training stopped on a signal at the start of ``step``; the state is saved in ``checkpoint``
    (None: the ranks of a multi-process cell ended before any checkpoint)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        saved = f"saved {checkpoint}" if checkpoint else "no checkpoint yet"
        super().__init__(f"{signal.Signals(signum).name} at step {step}; {saved}")

    def __reduce__(self) -> tuple:  # rank 0 reports it to the worker, pickled
        return (Interrupted, (self.signum, self.step, self.checkpoint))


class StopRequest:
    """Catches SIGINT and SIGTERM while active (a context manager); ``signum`` is the first one
    received, or None. Outside the main thread it installs nothing (Python allows handlers only
    there) and never fires.

    Until :meth:`arm` is called (the sweep calls it once the corpus is built and the store is
    open, when there is a cell to save), Ctrl-C raises ``KeyboardInterrupt`` at once: nothing
    is half-done then, and a long corpus build should not need a second Ctrl-C. A rank
    (``rank=True``) is armed from the start and never raises: torchrun passes on the signal it
    got, so a rank hears one Ctrl-C twice.
    """

    def __init__(self, rank: bool = False) -> None:
        self.signum: int | None = None
        self.armed = self.rank = rank
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
        if signum == signal.SIGINT and not self.rank and (not first or not self.armed):
            raise KeyboardInterrupt  # before training, or a second Ctrl-C: stop now

    @property
    def exit_code(self) -> int:
        """130 after SIGINT, 143 after SIGTERM, 0 when no signal came."""
        return EXIT_CODES.get(self.signum, 0) if self.signum else 0


# Opened once at import: ``die_with_parent`` also runs between fork and exec (``preexec_fn``),
# where a dlopen could wait forever on a lock another thread of the parent held.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def die_with_parent(parent: int, sig: int = signal.SIGTERM) -> None:
    """Have the kernel send ``sig`` to this process when process ``parent`` (the one that
    started it) dies (Linux's ``PR_SET_PDEATHSIG``; elsewhere nothing). With SIGTERM the process
    saves its cell and leaves."""
    if _LIBC is not None:
        _LIBC.prctl(1, int(sig))  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # it died before the line above: nothing would signal us
            os._exit(1)


def child_preexec(parent: int) -> Callable[[], None]:
    """``preexec_fn`` of a worker or of torchrun started by process ``parent``: SIGUSR2 ignored
    (SLURM may send submitit's signal to every process of the job), SIGTERM when ``parent`` dies."""

    def preexec() -> None:
        signal.signal(PREEMPTION, signal.SIG_IGN)
        die_with_parent(parent, signal.SIGTERM)

    return preexec


def wait_forwarding(procs: list[subprocess.Popen], stop: StopRequest | None, poll_s: float = 0.2) -> None:
    """Wait until every process of ``procs`` has exited; once ``stop`` holds a signal, send each
    one still running SIGTERM, once (a signal sent to this process alone reaches them too). Polls:
    ``Popen.wait`` would hold a lock a signal handler's own wait could wait on for ever."""
    forwarded = False
    while any(p.poll() is None for p in procs):
        if stop is not None and stop.signum is not None and not forwarded:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            forwarded = True
        time.sleep(poll_s)


class Unwound(KeyboardInterrupt):
    """Ctrl-C or SIGTERM outside training (:func:`unwinding`); ``exit_code`` 130 or 143."""

    def __init__(self, signum: int) -> None:
        super().__init__()
        self.exit_code = EXIT_CODES[signum]


@contextlib.contextmanager
def unwinding() -> Iterator[None]:
    """While inside (the CLI's whole command), Ctrl-C or SIGTERM raises :class:`Unwound`, and any
    further signal is ignored (``timeout`` and some shells signal the process and its group both)
    so that one line is all that is said. A :class:`StopRequest` takes over during training."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def once(signum: int, frame: FrameType | None) -> None:
        for sig in EXIT_CODES:
            signal.signal(sig, signal.SIG_IGN)
        raise Unwound(signum)

    previous = {sig: signal.signal(sig, once) for sig in EXIT_CODES}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Block SIGINT and SIGTERM in this thread while inside (POSIX); pending ones arrive on leaving."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set(EXIT_CODES))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
