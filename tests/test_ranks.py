"""The ranks torchrun starts (``sweep.run.ranks.launch``): their places are torchrun's, they
handle the sweep's signals as one process does, and a second Ctrl-C leaves none running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest

from sweep.run.ranks import RanksFailed, end_orphan_ranks, launch, node_commands
from tests.support import process_state, ranks_of

pytestmark = pytest.mark.slow  # make test-all: processes, signals, faults

LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def lightning_place() -> tuple[int, int, str]:
    """Where Lightning puts this rank of a 2-device DDP trainer: (global rank, world size, the
    cluster environment it chose)."""
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    env = trainer.strategy.cluster_environment
    return trainer.global_rank, trainer.world_size, type(env).__name__


def dispositions() -> dict[str, str]:
    """This rank's handlers of SIGINT, SIGTERM and SIGUSR2, by name."""
    found = {}
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2):
        handler = signal.getsignal(s)
        found[s.name] = "SIG_IGN" if handler == signal.SIG_IGN else getattr(handler, "__qualname__", "?")
    return found


def nap(seconds: float) -> str:
    time.sleep(seconds)
    return "woke"


def rank_1_fails() -> None:
    """Rank 1 raises; rank 0 waits as it would in a collective that never completes."""
    if os.environ["RANK"] == "1":
        raise ValueError("disk full on rank 1")
    time.sleep(300)


def rank_0_fails() -> None:
    if os.environ["RANK"] == "0":
        raise ValueError("bad batch on rank 0")
    time.sleep(300)


def test_inside_a_slurm_job_the_ranks_take_their_places_from_torchrun(monkeypatch) -> None:
    """Under SLURM (a task of 2: rank 1) Lightning would read every rank's place from
    ``SLURM_PROCID``; the ranks see none of ``SLURM_*`` and rank 0 is rank 0 of 2."""
    for name, value in {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "1",
                        "SLURM_NODEID": "1", "SLURM_JOB_NAME": "sweep-worker"}.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    assert launch(lightning_place, 2) == (0, 2, "TorchElasticEnvironment")


def test_a_rank_stops_on_the_sweeps_signals_ignores_submitits_and_the_caller_keeps_its_handlers() -> None:
    handler = signal.signal(signal.SIGUSR2, lambda *_: None)
    try:
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)}
        seen = launch(dispositions, 1)
        stop = "StopRequest._handle"
        assert seen == {"SIGINT": stop, "SIGTERM": stop, "SIGUSR2": "SIG_IGN"}
        assert {s: signal.getsignal(s) for s in before} == before
    finally:
        signal.signal(signal.SIGUSR2, handler)


def test_rank_0s_error_is_raised_in_the_caller_and_another_ranks_ends_the_cell() -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match="bad batch on rank 0"):
        launch(rank_0_fails, 2)
    with pytest.raises(RanksFailed, match="torchrun exited 1 without rank 0's outcome"):
        launch(rank_1_fails, 2)
    assert time.monotonic() - started < 120  # not rank 0's 300 s wait


class SecondCtrlC:
    """A stop request whose 30th look (6 s in) raises KeyboardInterrupt (a second Ctrl-C), after
    noting the ranks then running."""

    def __init__(self) -> None:
        self.asked, self.ranks = 0, []

    @property
    def signum(self) -> int | None:
        self.asked += 1
        if self.asked == 30:
            self.ranks = ranks_of(os.getpid())
            raise KeyboardInterrupt
        return None


@LINUX
def test_a_second_ctrl_c_while_the_ranks_run_propagates_and_torchrun_ends_them() -> None:
    stop = SecondCtrlC()
    with pytest.raises(KeyboardInterrupt):
        launch(nap, 2, 300.0, stop=stop)
    assert len(stop.ranks) == 2  # both were up, sleeping
    deadline = time.monotonic() + 60  # torchrun: SIGTERM (a rank only notes it), 30 s, SIGKILL
    while any(process_state(pid) not in (None, "Z") for pid in stop.ranks):
        assert time.monotonic() < deadline, "ranks left running"
        time.sleep(0.1)


def test_a_cell_on_two_nodes_starts_one_torchrun_per_node_here_and_one_srun_in_a_slurm_job(
    monkeypatch, tmp_path: Path
) -> None:
    job = tmp_path / "job.pkl"
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    (one,) = node_commands(job, 4, 1)
    assert one[1:] == [
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=4",
        "--standalone",
        "-m",
        "sweep.run.ranks",
        str(job),
    ]
    here = node_commands(job, 2, 2, "cell7")
    assert len(here) == 2 and here[0] == here[1]
    assert here[0][4:8] == ["--nnodes=2", "--rdzv-backend=c10d", here[0][6], "--rdzv-id=cell7"]
    assert here[0][6].startswith("--rdzv-endpoint=127.0.0.1:")
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.setenv("PATH", str(tmp_path), prepend=os.pathsep)
    (tmp_path / "srun").write_text("#!/bin/sh\n")
    (tmp_path / "srun").chmod(0o755)
    (srun,) = node_commands(job, 8, 16, "cell7")
    # --mem=0: the step shares the job's memory too, where SLURM tracks it (make slurm-check)
    assert srun[:6] == [
        "srun",
        "--overlap",
        "--mem=0",
        "--nodes=16",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
    ]
    assert "--nnodes=16" in srun and "--nproc-per-node=8" in srun


def test_a_dead_workers_hung_ranks_are_killed_and_nothing_else_that_names_the_folder(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints" / "run1"
    job = folder / ".ranks-abc" / "job.pkl"
    hang = "import time; time.sleep(300)"
    rank = subprocess.Popen([sys.executable, "-c", hang, "-m", "sweep.run.ranks", str(job)])
    viewer = subprocess.Popen([sys.executable, "-c", hang, str(folder / "step5.ckpt")])  # tail -f, say
    other = subprocess.Popen([sys.executable, "-c", hang, "sweep.run.ranks", str(tmp_path / ".ranks-x")])
    try:
        assert end_orphan_ranks(folder, wait_s=0.5) == [rank.pid]
        assert process_state(rank.pid) is None  # killed and reaped
        assert viewer.poll() is None and other.poll() is None  # left alone
        assert end_orphan_ranks(folder, wait_s=0.5) == []  # none left: returns at once
    finally:
        for p in (rank, viewer, other):
            p.kill()
            p.wait()
