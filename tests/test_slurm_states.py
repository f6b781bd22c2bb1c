"""The driver's reading of a SLURM job through its requeues, replayed from what SLURM 22.05 said
on ``make slurm-check``'s cluster (``tests/slurm_states/``: every change of ``scontrol -o show
job`` and ``sacct``, steps included, recorded by ``python -m tools.slurm_check --record DIR``).

Around each requeue SLURM reports transitions a reader could take for an end: ``COMPLETING`` as
the run is killed, ``PENDING`` on its ``BeginTime``; in ``sacct`` the job ``REQUEUED`` or
``PREEMPTED``, its batch step ``CANCELLED`` and, after a time limit, its ``srun`` step ``FAILED``
(exit 127) while the job waits for its next run. The driver reads none of them as the job's end,
from ``scontrol`` or, once slurmctld has let a job go, ``sacct``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sweep.run import slurm_jobs

STATES = Path(__file__).parent / "slurm_states"


def recording(name: str) -> list[dict]:
    """The readings of one job, in order (each: ``scontrol``'s line or None, ``sacct``'s rows)."""
    return [json.loads(line) for line in (STATES / name).read_text().splitlines()]


class Replay:
    """Answers the driver's ``scontrol`` and ``sacct`` with one recorded reading a poll (the last
    repeated); ``scontrol_gone``: slurmctld has let the job go, so only ``sacct`` answers."""

    def __init__(self, readings: list[dict], scontrol_gone: bool = False) -> None:
        self.readings, self.scontrol_gone, self.at = readings, scontrol_gone, -1

    def __call__(self, command: list[str]):
        import subprocess

        done = lambda out, code=0, err="": subprocess.CompletedProcess(command, code, out, err)  # noqa: E731
        if command[:3] == ["scontrol", "show", "config"]:
            return done("AccountingStorageType   = accounting_storage/slurmdbd\n")
        first = "sacct" if self.scontrol_gone else "scontrol"
        if command[0] == first:  # one reading a poll: the first command the driver asks
            self.at = min(self.at + 1, len(self.readings) - 1)
        reading = self.readings[max(self.at, 0)]
        if command[0] == "scontrol":
            line = None if self.scontrol_gone else reading["scontrol"]
            if line is None:
                return done("", 1, "slurm_load_jobs error: Invalid job id specified")
            return done(line + "\n")
        job = command[command.index("-j") + 1]
        rows = [r for r in reading["sacct"].splitlines() if r.split("|")[0].split(".")[0] == job]
        if "-X" in command:  # the allocation's rows only, not its steps'
            rows = [r for r in rows if r.split("|")[0] == job]
        return done("".join(f"{r}\n" for r in rows))

    @property
    def last(self) -> bool:
        return self.at == len(self.readings) - 1


def follow(monkeypatch: pytest.MonkeyPatch, readings: list[dict], scontrol_gone: bool = False):
    """Poll a watch of the recorded job once per reading: its lines, and the readings it had
    polled when it first said the job ended (None: never)."""
    replay = Replay(readings, scontrol_gone)
    monkeypatch.setattr(slurm_jobs, "_run", replay)
    job = readings[0]["job"]
    lines: list[str] = []
    watch = slurm_jobs.JobWatch([job], lines.append)
    for _ in readings:
        if watch.poll():
            return lines, replay.at + 1, watch.last[job]
    return lines, None, watch.last[job]


#: Each recording: the job's end as SLURM gave it (state, exit code) and its requeues.
RECORDED = {
    # make slurm-check's time-limit case: 4-minute jobs, each warned (USR2) and requeued by submitit
    "time_limit_five_requeues.jsonl": ("COMPLETED", "0:0", 5),
    # the same case on main (9e11fc9): 3-minute jobs, the fourth warning past submitit's bound of
    # 3 ("timed-out too many times" raised in the job): exit 1
    "time_limit_past_submitit_bound.jsonl": ("FAILED", "1:0", 3),
    "scontrol_requeue.jsonl": ("COMPLETED", "0:0", 1),  # requeued by hand
    "preempted_requeued_by_slurm.jsonl": ("COMPLETED", "0:0", 1),  # PreemptMode=REQUEUE, no grace
    "preempted_with_grace_requeued_itself.jsonl": ("COMPLETED", "0:0", 1),  # GraceTime=60
}
#: The recordings of time limits: a requeued run's srun step reads FAILED (exit 127) in sacct.
TIME_LIMITS = sorted(name for name in RECORDED if name.startswith("time_limit"))


def state_of(text: str | None, job: str, source: str) -> tuple[str, str] | None:
    """(state, exit code) of ``job`` in a reading of ``source``."""
    if source == "scontrol":
        found = re.search(r"JobState=(\S+) .*ExitCode=(\S+)", text or "")
        return found.groups() if found else None
    row = next((r.split("|") for r in (text or "").splitlines() if r.split("|")[0] == job), None)
    return (row[1].split()[0], row[2]) if row else None


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_the_recordings_hold_the_transitions_around_a_requeue(name: str) -> None:
    readings = recording(name)
    job, (state, code, requeues) = readings[0]["job"], RECORDED[name]
    states = [state_of(r["scontrol"], job, "scontrol") for r in readings]
    assert {"RUNNING", "COMPLETING", "PENDING"} <= {s[0] for s in states if s}
    assert states[-1] == (state, code)
    restarts = [int(re.search(r"Restarts=(\d+)", r["scontrol"]).group(1)) for r in readings if r["scontrol"]]
    assert max(restarts) == requeues
    sacct = [state_of(r["sacct"], job, "sacct") for r in readings]
    assert {"REQUEUED", "PREEMPTED"} & {s[0] for s in sacct if s}  # sacct's name of the killed run
    if name in TIME_LIMITS:  # a requeued run's failed step, while the job is requeued: not its end
        assert any(
            f"{job}.0|FAILED|127:0" in r["sacct"] and sacct[i] and sacct[i][0] == "REQUEUED"
            for i, r in enumerate(readings)
        )


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_the_driver_follows_a_job_through_every_requeue_until_scontrol_says_it_ended(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    readings = recording(name)
    job, (state, code, requeues) = readings[0]["job"], RECORDED[name]
    lines, polled, last = follow(monkeypatch, readings)
    ended_at = next(
        i for i, r in enumerate(readings) if state_of(r["scontrol"], job, "scontrol") == (state, code)
    )
    assert polled == ended_at + 1  # not a reading earlier
    assert [x for x in lines if "requeued (run" in x] == [
        f"job {job}: requeued (run {n})" for n in range(2, requeues + 2)
    ]
    assert (
        last.describe()
        == f"{state} (exit {code}, requeued {requeues} time{'s' * (requeues > 1)}), from scontrol"
    )


@pytest.mark.parametrize("name", TIME_LIMITS)
def test_the_driver_reads_sacct_the_same_through_a_time_limit_requeue_and_its_failed_step(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """From ``sacct`` alone (``scontrol`` no longer knows the job; from its first accounting
    record: slurmdbd hears of a job a moment late): the job's own row, never its steps'."""
    readings = recording(name)
    readings = readings[next(i for i, r in enumerate(readings) if r["sacct"]) :]
    job, (state, code, _) = readings[0]["job"], RECORDED[name]
    _, polled, last = follow(monkeypatch, readings, scontrol_gone=True)
    ended_at = next(i for i, r in enumerate(readings) if state_of(r["sacct"], job, "sacct") == (state, code))
    assert polled == ended_at + 1
    assert last.describe() == f"{state} (exit {code}), from sacct"


def test_the_check_releases_a_requeued_job_only_seconds_after_its_requeue() -> None:
    """``make slurm-check`` starts a requeued job early, but never in the second slurmd revoked
    its credential (CI's time-limit case: released 0.45 s after the requeue, "Job credential
    revoked", the job FAILED with exit 1)."""
    from tools.slurm_case import RELEASE_AFTER_S, due_for_release

    seen: dict[str, float] = {}
    assert due_for_release({"12": "BeginTime", "13": "Resources"}, seen, 100.0) == []
    assert seen == {"12": 100.0}
    assert due_for_release({"12": "BeginTime"}, seen, 100.0 + RELEASE_AFTER_S - 0.5) == []
    assert due_for_release({"12": "BeginTime"}, seen, 100.0 + RELEASE_AFTER_S) == ["12"]
    assert seen == {}
    # the next requeue of the same job waits its own time again
    assert due_for_release({"12": "BeginTime"}, seen, 300.0) == []
    # a job started meanwhile is forgotten, so a later hold is timed from its own start
    assert due_for_release({}, seen, 300.5) == [] and seen == {}
