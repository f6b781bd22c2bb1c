"""One case of ``make slurm-check`` (:mod:`tools.slurm_check`): its folder and sweep command on
the throwaway cluster, the SLURM commands it runs, and :func:`verify`, what the docs promise
after the sweep returned.
"""

from __future__ import annotations

import contextlib
import csv
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from tools.servers_check import ROOT, loss_history, same_losses
from tools.slurm_cluster import Cluster

ROWS = ("baseline", "sdpa_elementwise")  # the check's grid's rows
FINAL_LINE = re.compile(r"^job (\d+) ended (\S+)", re.M)


class Case:
    """One case's folder, grid and sweep command, and the failures found (one line each)."""

    def __init__(self, name: str, work: Path, cluster: Cluster, grid: str, steps: int) -> None:
        self.name, self.cluster, self.steps = name, cluster, steps
        self.folder = work / name
        self.folder.mkdir(parents=True)
        self.grid = self.folder / "slurm.yaml"
        self.grid.write_text(grid.replace("STEPS", str(steps)))
        self.results = self.folder / "results"
        self.failures: list[str] = []
        self.note = ""  # what the case measured, for its verdict line

    def command(self, workers: int = 2, *extra: str) -> list[str]:
        command = [sys.executable, "-m", "sweep.cli", "sweep", "--grid", str(self.grid), "--results"]
        command += [str(self.results), "--launcher", "slurm", "--workers", str(workers)]
        return [*command, "--gpus-per-worker", "0", "--cpus-per-worker", "1", "--time-limit", "10", *extra]

    def env(self) -> dict[str, str]:
        env = {**self.cluster.env(), "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        env.setdefault("GATED_ATTN_CACHE", str(ROOT / ".cache"))
        env.pop("MLFLOW_TRACKING_URI", None)
        return env

    def start(self, command: list[str], log: str = "sweep.log") -> subprocess.Popen:
        with open(self.folder / log, "a") as sink:
            return subprocess.Popen(command, cwd=ROOT, env=self.env(), stdout=sink, stderr=subprocess.STDOUT)

    def log(self, name: str = "sweep.log") -> str:
        return (self.folder / name).read_text()

    def fail(self, line: str) -> None:
        self.failures.append(f"{self.name}: {line}")


def slurm(*command: str, env: dict[str, str]) -> str:
    return subprocess.run(list(command), env=env, capture_output=True, text=True, timeout=60).stdout


def first_checkpoint(case: Case, procs: list[subprocess.Popen], timeout_s: float = 300) -> Path:
    """The first run folder of ``case`` with a ``step*.ckpt``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for ckpt in sorted((case.results / "checkpoints").glob("*/*/step*.ckpt")):
            return ckpt.parent
        if all(p.poll() is not None for p in procs):
            raise RuntimeError(f"{case.name}: the sweep ended before a checkpoint was written")
        time.sleep(0.05)
    raise RuntimeError(f"{case.name}: no checkpoint within {timeout_s:.0f} s")


def job_of(run_folder: Path) -> str:
    """The SLURM job whose worker trains the run of ``run_folder`` (its ``worker`` tag's pid)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_folder.parents[2] / 'mlflow.db'}")
    pid = client.get_run(run_folder.name).data.tags["worker"].rsplit(":", 1)[1]
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"SLURM_JOB_ID="))


#: How long a requeued job waits in ``BeginTime`` before :class:`Releaser` starts it. slurmd
#: revokes a requeued job's credential at the second it kills the run; a new run launched in that
#: same second is refused ("Job 12 already killed, do not launch batch job") and SLURM ends the job
#: ``FAILED`` with exit 1. CI's run of the time-limit case was released 0.45 s after its requeue
#: and so failed; SLURM's own 120 s hold never meets this.
RELEASE_AFTER_S = 2.0


def due_for_release(pending: dict[str, str], seen: dict[str, float], now: float) -> list[str]:
    """The jobs of ``pending`` (job id -> squeue's reason) held by ``BeginTime`` for
    :data:`RELEASE_AFTER_S` or more; ``seen`` (job id -> when first seen so held) is updated in place:
    a job seen for the first time is recorded, one no longer held or due now is forgotten."""
    held = {job for job, reason in pending.items() if reason == "BeginTime"}
    for job in set(seen) - held:
        del seen[job]
    due = []
    for job in sorted(held):
        first = seen.setdefault(job, now)
        if now - first >= RELEASE_AFTER_S:
            due.append(job)
            del seen[job]
    return due


class Releaser(threading.Thread):
    """Starts the case's requeued jobs :data:`RELEASE_AFTER_S` after their requeue instead of
    after SLURM's 120 s ``BeginTime``."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(daemon=True)
        self.env, self.done = env, threading.Event()

    def run(self) -> None:
        seen: dict[str, float] = {}
        while not self.done.wait(0.5):
            lines = slurm("squeue", "-h", "-t", "PD", "-o", "%i %r", env=self.env).splitlines()
            pending = {job: reason.strip() for job, _, reason in (x.partition(" ") for x in lines)}
            for job in due_for_release(pending, seen, time.monotonic()):
                slurm("scontrol", "update", f"JobId={job}", "StartTime=now", env=self.env)


class Recorder(threading.Thread):
    """Writes every reading of the cluster's jobs that differs from the one before, as SLURM
    gives it (``scontrol -o show job``'s line, ``sacct``'s rows with the steps), one JSON line
    each, to ``path``: ``{"t": seconds since the start, "job": id, "scontrol": line or null,
    "sacct": rows}``. ``make slurm-check --record DIR`` keeps one file a case; the driver's
    tests replay them (tests/slurm_states/)."""

    FIELDS = re.compile(r"\b(JobState|Reason|Restarts|ExitCode|BatchFlag|PreemptTime|StartTime)=(\S*)")

    def __init__(self, env: dict[str, str], path: Path, poll_s: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.env, self.path, self.poll_s, self.done = env, path, poll_s, threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        import json

        last: dict[str, tuple] = {}
        with self.path.open("a") as sink:
            while not self.done.wait(self.poll_s):
                lines = slurm("scontrol", "-o", "show", "job", env=self.env).splitlines()
                held = {x.split()[0].removeprefix("JobId="): x for x in lines if x.startswith("JobId=")}
                rows = slurm("sacct", "-n", "-P", "-o", "JobID,State,ExitCode", env=self.env).splitlines()
                jobs = set(held) | {r.split("|")[0].split(".")[0] for r in rows if r}
                for job in sorted(jobs, key=int):
                    mine = "\n".join(r for r in rows if r.split("|")[0].split(".")[0] == job)
                    line = held.get(job)
                    key = (tuple(self.FIELDS.findall(line)) if line else None, mine)
                    if last.get(job) != key:
                        last[job] = key
                        t = round(time.monotonic() - self.t0, 2)
                        sink.write(json.dumps({"t": t, "job": job, "scontrol": line, "sacct": mine}) + "\n")
                        sink.flush()


@contextlib.contextmanager
def recording(env: dict[str, str], path: Path | None) -> Iterator[None]:
    """A :class:`Recorder` of the cluster's jobs into ``path`` while inside (none without a path)."""
    if path is None:
        yield
        return
    recorder = Recorder(env, path)
    recorder.start()
    try:
        yield
    finally:
        recorder.done.set()
        recorder.join()


def verify(
    case: Case,
    code: int,
    reference: Path | None,
    resumed: set[str] = frozenset(),
    rel: float = 1e-5,
    rows: tuple[str, ...] = ROWS,
    jobs: bool = True,
) -> None:
    """What the docs promise after the sweep returned ``code`` (see the module docstring):
    the cells of ``rows``, the runs of ``resumed`` resumed in themselves, the losses of
    ``reference``'s runs, and (with ``jobs``) the jobs' final states."""
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    out = case.log()
    if code != 0:
        case.fail(f"the sweep exited {code}: {out[-1500:]}")
    table = case.results / "slurm.csv"
    table_rows = list(csv.DictReader(table.open())) if table.exists() else []
    found = {r["id"]: r["status"] for r in table_rows if r["avg_ppl"]}
    if any(found.get(row) != "ok" for row in rows):
        case.fail(f"the table is not whole when the command returns: {found}, want {rows} ok")
    client = MlflowClient(tracking_uri=f"sqlite:///{case.results / 'mlflow.db'}")
    ref = MlflowClient(tracking_uri=f"sqlite:///{reference / 'mlflow.db'}") if reference else None
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], "tags.kind = 'cell'",
                              run_view_type=ViewType.ALL)  # fmt: skip
    keys = [r.data.tags["run_key"] for r in runs]
    if sorted(keys) != sorted(set(keys)) or len(keys) != len(rows):
        case.fail(f"runs per cell: {keys}; want one for each of {len(rows)} cells")
    want = {r.data.tags["run_key"]: r for r in _runs(ref)} if ref else {}
    for run in runs:
        key, row, got = run.data.tags["run_key"], run.data.tags["row"], loss_history(client, run.info.run_id)
        if run.data.tags.get("status") != "finished":
            case.fail(f"{row}: run {run.info.run_id} is {run.data.tags.get('status')}")
        if [s for s, _ in got] != list(range(case.steps)):
            case.fail(f"{row}: train/loss has {len(got)} points, not each of {case.steps} steps once")
        elif key in want and not same_losses(got, loss_history(ref, want[key].info.run_id), rel):
            case.fail(f"{row}: train/loss differs from the uninterrupted run's")
        if run.info.run_id in resumed and not run.data.tags.get("resumed"):
            case.fail(f"{row}: its run {run.info.run_id} was interrupted but not resumed in itself")
    for job, state in FINAL_LINE.findall(out):  # as SLURM's accounting has it after the end
        said = slurm("sacct", "-X", "-n", "-P", "-o", "State", "-j", job, env=case.env()).split()
        if not said or said[0] != state:
            case.fail(f"job {job}: the driver said {state}, sacct says {said[:1]}")
    if jobs and not FINAL_LINE.findall(out):
        case.fail("the driver printed no job's final state")


def _runs(client):
    from mlflow.entities import ViewType

    ids = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(ids, "tags.kind = 'cell'", run_view_type=ViewType.ALL)
    return [r for r in runs if r.data.tags.get("status") == "finished"]


def wait(proc: subprocess.Popen, timeout_s: float = 600) -> int:
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the driver cancels its jobs, saved
        return proc.wait(timeout=120)


@contextlib.contextmanager
def releasing(case: Case) -> Iterator[Releaser]:
    releaser = Releaser(case.env())
    releaser.start()
    try:
        yield releaser
    finally:
        releaser.done.set()
        releaser.join()
