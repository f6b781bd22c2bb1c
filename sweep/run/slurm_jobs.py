"""What SLURM says of a job, read where it is true: ``scontrol`` while slurmctld holds the job,
``sacct`` once it has let it go (``MinJobAge`` after its end, 300 s by default).

The cluster launcher (:mod:`sweep.run.slurm`) follows each job through its requeues with
:class:`JobWatch` until SLURM says it ended, and a job asks :func:`preempted_with_grace` after
its worker stopped on SIGTERM, to requeue itself (:func:`requeue`) when SLURM pre-empted it with
a grace time (it would otherwise end ``COMPLETED``, saved, and never run again).
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Job states SLURM never leaves (``squeue --help``'s list, less those a requeue leaves).
ENDED = frozenset(
    {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "TIMEOUT"}
)
#: A job pre-empted with ``PreemptMode=CANCEL`` ends so; with ``REQUEUE`` it is pending again at
#: once: counted as ended only once seen twice, one poll apart.
PREEMPTED = "PREEMPTED"
UNKNOWN = "UNKNOWN"
TIMEOUT_S = 30  # a slurmctld that does not answer a query within this is asked again next poll


@dataclass(frozen=True)
class JobState:
    """One reading of a job: ``state`` (``RUNNING``, ``COMPLETED``, ...; ``UNKNOWN`` when neither
    command knows it), the times SLURM requeued it, its exit code (``0:0``), why it is pending,
    and which command said so (``scontrol``, ``sacct``, or "")."""

    state: str
    restarts: int = 0
    exit_code: str = ""
    reason: str = ""
    source: str = ""

    def describe(self) -> str:
        """``PENDING (BeginTime)``, ``COMPLETED (exit 0:0, requeued 2 times), from sacct``."""
        notes = []
        if self.state == "PENDING" and self.reason not in ("", "None"):
            notes.append(self.reason)
        if self.state in ENDED | {PREEMPTED} and self.exit_code:
            notes.append(f"exit {self.exit_code}")
        if self.restarts:
            notes.append(f"requeued {self.restarts} time{'s' if self.restarts > 1 else ''}")
        text = f"{self.state} ({', '.join(notes)})" if notes else self.state
        if self.state in ENDED | {PREEMPTED, UNKNOWN} and self.source:
            text += f", from {self.source}"
        return text


class Unanswered(RuntimeError):
    """slurmctld (or slurmdbd) did not answer a query: ask again at the next poll."""


def _run(command: list[str]) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _field(text: str, key: str) -> str:
    found = re.search(rf"(?:^|\s){key}=(\S*)", text)
    return found.group(1) if found else ""


def scontrol_job(job_id: str) -> dict[str, str] | None:
    """``scontrol -o show job`` of ``job_id`` as {JobState, Restarts, ExitCode, Reason,
    PreemptTime}, or None when slurmctld does not hold it.

    Raises:
        Unanswered: scontrol failed otherwise (slurmctld down or busy).
    """
    done = _run(["scontrol", "-o", "show", "job", str(job_id)])
    if done is not None and done.returncode != 0 and "Invalid job id" in done.stderr:
        return None
    if done is None or done.returncode != 0 or f"JobId={job_id} " not in done.stdout:
        raise Unanswered(f"scontrol show job {job_id}: {(done.stderr if done else 'no answer').strip()}")
    line = next(x for x in done.stdout.splitlines() if x.startswith(f"JobId={job_id} "))
    return {k: _field(line, k) for k in ("JobState", "Restarts", "ExitCode", "Reason", "PreemptTime")}


def accounting_off() -> str | None:
    """Why ``sacct`` cannot answer on this cluster (its ``AccountingStorageType`` is none), or
    None when it can."""
    done = _run(["scontrol", "show", "config"])
    if done is None or done.returncode != 0:
        return None
    kind = re.search(r"^AccountingStorageType\s*=\s*(\S+)", done.stdout, re.M)
    if kind and kind.group(1).endswith("/none"):
        return f"AccountingStorageType={kind.group(1)}"
    return None


def sacct_job(job_id: str) -> JobState | None:
    """The job's last record in SLURM's accounting (``sacct -X``), or None without one.

    Raises:
        Unanswered: sacct failed (slurmdbd down or busy).
    """
    done = _run(["sacct", "-X", "-n", "-P", "-o", "JobID,State,ExitCode", "-j", str(job_id)])
    if done is None or done.returncode != 0:
        raise Unanswered(f"sacct -j {job_id}: {(done.stderr if done else 'no answer').strip()}")
    rows = [r.split("|") for r in done.stdout.splitlines() if r.startswith(f"{job_id}|")]
    if not rows:
        return None
    _, state, code = rows[-1][:3]
    return JobState(state.split()[0], exit_code=code, source="sacct")  # "CANCELLED by 0"


def job_state(job_id: str, accounting: bool = True) -> JobState:
    """What SLURM says of ``job_id`` now: scontrol's reading, else sacct's (with ``accounting``),
    else ``UNKNOWN`` (neither holds it).

    Raises:
        Unanswered: see :func:`scontrol_job`, :func:`sacct_job`.
    """
    fields = scontrol_job(job_id)
    if fields is not None:
        restarts = int(fields["Restarts"]) if fields["Restarts"].isdigit() else 0
        state = fields["JobState"] or UNKNOWN
        return JobState(state, restarts, fields["ExitCode"], fields["Reason"], "scontrol")
    found = sacct_job(job_id) if accounting else None
    return found or JobState(UNKNOWN)


def preempted_with_grace(job_id: str) -> bool:
    """Whether SLURM is pre-empting the running ``job_id`` with a grace time: still RUNNING,
    with a ``PreemptTime`` (SIGTERM came at the grace time's start; with ``PreemptMode=REQUEUE``
    the job is requeued only if SLURM has to kill it at the grace time's end). Not so for a job
    cancelled, requeued by hand or pre-empted without a grace time: SLURM ends it already."""
    try:
        fields = scontrol_job(job_id)
    except Unanswered:
        return False
    return (
        fields is not None and fields["JobState"] == "RUNNING" and fields["PreemptTime"] not in ("", "None")
    )


def requeue(job_id: str) -> bool:
    """``scontrol requeue job_id``; whether SLURM took it."""
    done = _run(["scontrol", "requeue", str(job_id)])
    return done is not None and done.returncode == 0


class JobWatch:
    """Follows SLURM jobs until each has ended, through its requeues: :meth:`poll` reads them
    all, says each change in one line, and returns whether every one has ended."""

    def __init__(self, job_ids: list[str], out: Callable[[str], None]) -> None:
        self.out = out
        self.last: dict[str, JobState] = {}
        self._preempted_at: dict[str, float] = {}  # when a job was first read PREEMPTED
        self._preempted_for_good: set[str] = set()
        off = accounting_off()
        self.accounting = off is None
        if off:
            out(
                f"SLURM accounting is off on this cluster ({off}): job states come from scontrol "
                "while slurmctld keeps a job (MinJobAge after its end)"
            )
        self.ids = list(job_ids)

    def ended(self, job_id: str) -> bool:
        """Whether SLURM has said that ``job_id`` ended: a state it never leaves, pre-empted for
        good (two readings), or gone from both scontrol and sacct."""
        reading = self.last.get(job_id)
        if reading is None:
            return False
        if reading.state == PREEMPTED:
            return job_id in self._preempted_for_good
        return reading.state in ENDED or reading.state == UNKNOWN

    def poll(self) -> bool:
        """Read every job not ended yet; a line for each new state or requeue. Returns True once
        all have ended. A query not answered leaves the last reading as it was."""
        for job_id in self.ids:
            if self.ended(job_id):
                continue
            before = self.last.get(job_id)
            try:
                now = job_state(job_id, self.accounting)
            except Unanswered:
                continue
            if now.state == UNKNOWN and before is not None:  # gone from both: its end is unread
                now = JobState(UNKNOWN, before.restarts)
            self.last[job_id] = now
            if now.state != PREEMPTED:
                self._preempted_at.pop(job_id, None)
            elif time.monotonic() - self._preempted_at.setdefault(job_id, time.monotonic()) > 1.0:
                self._preempted_for_good.add(job_id)
            if before is not None and now.restarts > before.restarts:
                self.out(f"job {job_id}: requeued (run {now.restarts + 1})")
            if (before is None or before.state != now.state) and not self.ended(job_id):
                self.out(f"job {job_id}: {now.describe()}")
        return all(self.ended(j) for j in self.ids)
