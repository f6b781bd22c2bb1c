"""Submitting the workers' jobs to SLURM: what SLURM refuses is refused in one line, before the
sweep enqueues anything where SLURM can tell, and a sweep is never left half-submitted.

:func:`preflight` asks SLURM before the driver writes anything: the partition's ``MaxTime`` and
``MaxNodes`` (a job over them is accepted, then pending for ever, ``PartitionTimeLimit``, on a
cluster with the default ``EnforcePartLimits=NO``), then ``sbatch --test-only`` of the very
script the jobs are submitted with (a partition, account or QOS SLURM does not know, a node
shape no node has, and the partition limits where ``EnforcePartLimits`` is set). :func:`submit`
submits the jobs; should ``sbatch`` still refuse one (a limit on submitted jobs, a partition
taken down meanwhile), the jobs already submitted are cancelled, submitit's leftover files
removed, and the refusal is one line. The cells stay enqueued, WAITING: the next sweep runs them.
"""

from __future__ import annotations

import contextlib
import io
import re
import subprocess
import tempfile
from typing import Any

TIMEOUT_S = 60  # a slurmctld that does not answer a query within this: the sweep says so


class LauncherError(RuntimeError):
    """The jobs cannot be submitted (no submitit, no SLURM here, an option out of range, a job
    SLURM refuses): one line, before anything is submitted."""


def slurm_minutes(text: str) -> float | None:
    """SLURM's duration (``MaxTime``: ``UNLIMITED``, ``30:00``, ``4:00:00``, ``1-00:00:00``) in
    minutes; None for no limit.

    Raises:
        ValueError: not a SLURM duration.
    """
    if text.upper() in ("UNLIMITED", "INFINITE", "NONE"):
        return None
    found = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", text)
    if found is None:
        raise ValueError(f"not a SLURM duration: {text!r}")
    days, a, b, c = (int(x) if x else 0 for x in found.groups())
    if found.group(1) is not None:  # days-hours[:minutes[:seconds]]
        return days * 1440 + a * 60 + b + c / 60
    if found.group(4) is not None:  # hours:minutes:seconds
        return a * 60 + b + c / 60
    return a + b / 60  # minutes[:seconds]


def _run(command: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise LauncherError(f"{' '.join(command[:3])}: SLURM did not answer within {TIMEOUT_S} s") from None


def said(stderr: str) -> str:
    """What SLURM said, in one line: its error lines less their ``sbatch: error:`` prefix, the
    last (``Batch job submission failed: ...``) first."""
    prefix = re.compile(r"^(sbatch|scontrol|allocation failure)(: error)?:\s*(Batch job submission failed:)?")
    lines = [prefix.sub("", x).strip() for x in stderr.splitlines() if x.strip()]
    if not lines:
        return "no message"
    last, rest = lines[-1], [x for x in lines[:-1] if x != lines[-1]]
    return f"{last} ({'; '.join(rest)})" if rest else last


def partition_limits(partition: str | None) -> tuple[str, float | None, int | None]:
    """The partition's name (``partition``, else the cluster's default), its ``MaxTime`` in minutes
    and its ``MaxNodes`` (None: no limit).

    Raises:
        LauncherError: SLURM knows no such partition, or no default one.
    """
    done = _run(["scontrol", "-o", "show", "partition", *([partition] if partition else [])])
    if done.returncode != 0:
        asked = f"--partition {partition}" if partition else "scontrol show partition"
        raise LauncherError(f"{asked}: SLURM says: {said(done.stderr or done.stdout)}")
    rows = [dict(re.findall(r"(\S+?)=(\S*)", line)) for line in done.stdout.splitlines() if line.strip()]
    row = rows[0] if partition else next((r for r in rows if r.get("Default") == "YES"), None)
    if row is None:
        raise LauncherError("this cluster has no default partition: name one (PARTITION=...)")
    nodes = row.get("MaxNodes", "UNLIMITED")
    max_nodes = int(nodes) if nodes.isdigit() else None
    return row["PartitionName"], slurm_minutes(row.get("MaxTime", "UNLIMITED")), max_nodes


def preflight(executor: Any, time_limit_min: int, nodes: int, partition: str | None) -> None:
    """Ask SLURM whether it would run the jobs ``executor`` submits (see the module docstring),
    before anything is enqueued or submitted.

    Raises:
        LauncherError: one line naming what SLURM said and the setting to change.
    """
    name, max_min, max_nodes = partition_limits(partition)
    if max_min is not None and time_limit_min > max_min:
        raise LauncherError(
            f"--time-limit {time_limit_min}: partition {name} lets a job run {max_min:g} minutes at most "
            f"(its MaxTime): give TIME_LIMIT={int(max_min)} or less, or another PARTITION"
        )
    if max_nodes is not None and nodes > max_nodes:
        raise LauncherError(
            f"the cells' train.num_nodes {nodes}: partition {name} gives a job {max_nodes} nodes at most "
            "(its MaxNodes): name another PARTITION"
        )
    # the script submitit would submit (a private method, pinned by tests/test_slurm.py)
    script = executor._executor._make_submission_file_text("true", "preflight")
    with tempfile.NamedTemporaryFile("w", suffix=".sh", prefix="gated-attn-preflight-") as f:
        f.write(script)
        f.flush()
        done = _run(["sbatch", "--test-only", f.name])
    if done.returncode != 0:
        raise LauncherError(f"sbatch refuses the workers' jobs: {said(done.stderr)}; nothing was submitted")


def submit(executor: Any, job: Any, count: int) -> list[Any]:
    """Submit ``job`` ``count`` times; the submitit jobs.

    Raises:
        LauncherError: ``sbatch`` refused one: the jobs submitted before it are cancelled, and
            submitit's files of the refused one removed.
    """
    from submitit.core.utils import FailedJobError, JobPaths

    folder = JobPaths.get_first_id_independent_folder(executor.folder)
    before = set(folder.iterdir()) if folder.is_dir() else set()
    jobs: list[Any] = []
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's refusal as it is
            for _ in range(count):
                jobs.append(executor.submit(job))
    except FailedJobError as err:
        for j in jobs:
            j.cancel(check=False)
        for leftover in set(folder.iterdir()) - before if folder.is_dir() else ():
            if leftover.is_file() and not leftover.is_symlink():  # the refused job's pickle and script
                leftover.unlink(missing_ok=True)  # (a submitted job's script is a link to its folder)
        ids = ", ".join(str(j.job_id) for j in jobs)
        cancelled = f"; cancelled the {len(jobs)} submitted before it ({ids})" if jobs else ""
        raise LauncherError(
            f"sbatch refused job {len(jobs) + 1} of {count}: {said(str(err))}{cancelled}; "
            "the cells stay queued for the next sweep"
        ) from None
    return jobs
