"""The ranks ``spawn_ranks`` starts: their places are its own, signals meant for the sweep leave
them alone, and nothing that ends the wait for them leaves one running."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import lightning.pytorch as pl
import pytest

from experiments.distributed import spawn_ranks
from tests.test_ddp import _ranks_of

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def lightning_place() -> tuple[int, int, str]:
    """Where Lightning puts this rank of a 2-device DDP trainer: (global rank, world size, the
    cluster environment it chose)."""
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    env = trainer.strategy.cluster_environment
    return trainer.global_rank, trainer.world_size, type(env).__name__


def dispositions() -> dict[str, object]:
    """This process's handlers of SIGINT, SIGTERM and SIGUSR2, by name, before anything here set one."""
    return {s.name: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)}


def nap(seconds: float) -> str:
    time.sleep(seconds)
    return "woke"


def test_inside_a_slurm_job_the_ranks_take_their_places_from_spawn_ranks(monkeypatch) -> None:
    """Under SLURM (a task of 2: rank 1) Lightning would read every rank's place from
    ``SLURM_PROCID``; the ranks see none of ``SLURM_*`` and rank 0 is rank 0 of 2."""
    for name, value in {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
                        "SLURM_NODEID": "1", "SLURM_JOB_NAME": "sweep-worker"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    assert spawn_ranks(lightning_place, 2) == (0, 2, "LightningEnvironment")


def test_the_ranks_ignore_the_sweeps_signals_from_their_start_and_the_caller_keeps_its_handlers() -> None:
    handler = signal.signal(signal.SIGUSR2, lambda *_: None)
    try:
        before = dispositions()
        seen = spawn_ranks(dispositions, 1)
        assert seen == {"SIGINT": signal.SIG_IGN, "SIGTERM": signal.SIG_IGN, "SIGUSR2": signal.SIG_IGN}
        assert dispositions() == before
    finally:
        signal.signal(signal.SIGUSR2, handler)


@LINUX
def test_signals_sent_to_the_ranks_from_their_first_moment_do_not_kill_them() -> None:
    """SLURM and a terminal signal every process of the job, ranks starting up included."""
    done = threading.Event()

    def pester() -> None:
        while not done.is_set():
            for pid in _ranks_of(os.getpid()):
                for sig in (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT):
                    os.kill(pid, sig)
            time.sleep(0.01)

    thread = threading.Thread(target=pester, daemon=True)
    thread.start()
    try:
        assert spawn_ranks(nap, 2, 3.0) == "woke"
    finally:
        done.set()
        thread.join()


@LINUX
def test_ctrl_c_while_the_ranks_run_ends_them_before_it_propagates() -> None:
    asked = []

    def interrupt() -> None:
        asked.append(time.monotonic())
        if len(asked) == 3:  # the ranks are up by now
            raise KeyboardInterrupt

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        spawn_ranks(nap, 2, 300.0, abort=interrupt)
    assert time.monotonic() - started < 60
    assert _ranks_of(os.getpid()) == []  # ended and reaped, not left sleeping


def test_ranks_started_from_another_thread_ignore_the_sweeps_signals_too() -> None:
    seen: list[object] = []
    thread = threading.Thread(target=lambda: seen.append(spawn_ranks(dispositions, 1)))
    thread.start()
    thread.join(timeout=120)
    assert seen == [{"SIGINT": signal.SIG_IGN, "SIGTERM": signal.SIG_IGN, "SIGUSR2": signal.SIG_IGN}]
