"""``make slurm-check``: ``LAUNCHER=slurm`` against a real SLURM, every case of docs/cluster.md.

A throwaway cluster on this machine (:mod:`tools.slurm_cluster`: Debian's SLURM, two slurmd,
accounting through slurmdbd, memory tracked), then, each in its own results folder, ``python -m
sweep.cli sweep --launcher slurm ...`` (what ``make sweep LAUNCHER=slurm`` runs) on a micro grid:

1. ``micro``: two jobs train the grid; a second driver started meanwhile trains nothing of it;
2. ``scancel``: a job cancelled mid-cell; the other job resumes its cell;
3. ``requeue``: ``scontrol requeue`` mid-cell; the requeued job resumes it;
4. ``time-limit``: a cell seven jobs of ``TIME_LIMIT=4`` long at the step time measured just
   before it (:mod:`tools.slurm_limits`); submitit's warning requeues the job at each limit, and
   the cell finishes in the one sweep after two time limits at least (more than five where the
   machine's load held still);
5. ``preempt``, ``preempt-grace``: a higher-priority partition's job pre-empts both jobs,
   without a grace time and with one (``GraceTime=60``); both are requeued and resume;
   ``preempt-usr2``: the same with a grace time where SLURM sends the jobs' own signal then
   (``preempt_send_user_signal``);
6. ``two-node``: a ``num_nodes: 2`` cell in one job of two nodes (``srun torchrun``);
7. ``driver-killed``: the driver gets SIGKILL mid-cell; its jobs finish; the same command again
   trains nothing and writes the whole table;
8. ``refusals``: a partition or an account SLURM does not know, a ``TIME_LIMIT`` over the
   partition's ``MaxTime``, a node shape no node has, and the launcher's numbers out of range:
   each one line, exit 2, nothing written, no job queued;
9. ``refused-later``: sbatch takes the first job and refuses the second (``MaxSubmitJobs=1``): the
   first is cancelled, one line, exit 2; the same command then trains every cell once.

Each asserts what the docs promise: the sweep exits 0; its table has every row; every cell is
one finished run, every step once, with the losses of a run that never stopped (relative 1e-5;
1e-4 for the two-node cell, against one process); an interrupted cell resumed in its own run;
the jobs' last lines give the state ``sacct`` reports after the end. SLURM holds a requeued job
120 s (its ``BeginTime``); the check starts such jobs 2 s after their requeue (``scontrol update
StartTime=now``; :data:`tools.slurm_case.RELEASE_AFTER_S` says why not sooner).
Exit status: 0 when every case passes, 1 when one fails (a line each), 2 when the cluster cannot
be installed or started. ``--keep`` keeps the folder (logs, stores); ``--cases`` picks cases;
``--record DIR`` writes every change of every job's ``scontrol`` and ``sacct`` reading, a file a
case (:class:`tools.slurm_case.Recorder`: the driver's tests replay them).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from tools.servers_check import GRID as SERVERS_GRID
from tools.servers_check import ROOT
from tools.slurm_case import Case, first_checkpoint, job_of, recording, releasing, slurm, verify, wait
from tools.slurm_cluster import ClusterError, install, interrupt, running
from tools.slurm_limits import case_refusals, case_refused_later, case_time_limit

STEPS = 600  # a cell of some seconds: long enough to stop after its first checkpoint
#: The servers check's grid, its two first rows (``STEPS`` steps, a checkpoint every 20).
GRID = (
    SERVERS_GRID.replace("name: servers", "name: slurm")
    .replace("Servers check", "SLURM check")
    .replace("max_steps: 240", "max_steps: STEPS")
    .replace("val_every: 80", "val_every: 200")
    .replace("checkpoint_every: 10}", "checkpoint_every: 20}")
)
GRID = "\n".join(line for line in GRID.splitlines() if "id: moe" not in line) + "\n"
TWO_NODE_GRID = GRID.replace("checkpoint_every: 20}", "checkpoint_every: 20, num_nodes: 2, strategy: ddp}")


def case_micro(case: Case, reference: Path) -> None:
    """Two drivers of the grid at once, two jobs and one: each cell is trained once, and each
    driver counts only what its own jobs trained (another's cells read skipped or busy)."""
    driver, second = case.start(case.command()), case.start(case.command(1), "second.log")
    code, other_code = wait(driver), wait(second)
    verify(case, code, reference)
    counts = [re.search(r"finished (\d+), resumed (\d+)", case.log(n)) for n in ("sweep.log", "second.log")]
    trained = [int(c.group(1)) + int(c.group(2)) if c else -1 for c in counts]
    if other_code != 0 or sum(trained) != 2:
        case.fail(
            f"the drivers exited {code}, {other_code} and counted {trained} cells as theirs: want 2 in all"
        )


def case_scancel(case: Case, reference: Path) -> None:
    driver = case.start(case.command())
    run = first_checkpoint(case, [driver])
    slurm("scancel", job_of(run), env=case.env())
    verify(case, wait(driver), reference, {run.name})


def case_requeue(case: Case, reference: Path) -> None:
    """One job, requeued by hand mid-cell: it runs again and resumes the cell."""
    with releasing(case):
        driver = case.start(case.command(1))
        run = first_checkpoint(case, [driver])
        job = job_of(run)
        slurm("scontrol", "requeue", job, env=case.env())
        verify(case, wait(driver), reference, {run.name})
    if f"job {job}: requeued (run 2)" not in case.log():
        case.fail(f"the driver did not follow job {job} through its requeue")


def case_preempt(case: Case, reference: Path, partition: str, self_requeue: bool = False) -> None:
    """Both jobs pre-empted by a job of the higher-priority partition ``urgent``: requeued
    (with a grace time: by themselves), run again and resumed."""
    with releasing(case):
        driver = case.start(case.command(2, "--partition", partition))
        run = first_checkpoint(case, [driver])
        urgent = ["sbatch", "--parsable", "-p", "urgent", "-N2", "--exclusive", "--wrap", "sleep 5"]
        slurm(*urgent, "-o", str(case.folder / "urgent.out"), env=case.env())
        verify(case, wait(driver), reference, {run.name})
    if "requeued (run 2)" not in case.log():
        case.fail("no job was requeued after its pre-emption")
    logs = "".join(p.read_text() for p in (case.results / "slurm").glob("*/*_log.out"))
    if self_requeue and "pre-empted with a grace time: requeued job" not in logs:
        case.fail("no job requeued itself in its grace time")


def case_preempt_usr2(case: Case, reference: Path) -> None:
    """``preempt_send_user_signal``: at pre-emption with a grace time SLURM sends the
    jobs' own ``--signal`` (USR2), and submitit's checkpoint stops the workers and requeues."""
    case.cluster.reconfigure(send_user_signal=True)
    try:
        case_preempt(case, reference, "grace")
    finally:
        case.cluster.reconfigure(send_user_signal=False)
    logs = "".join(p.read_text() for p in (case.results / "slurm").glob("*/*_log.*"))
    if "pre-emption or time limit: stopping the worker" not in logs or "Requeued job" not in logs:
        case.fail("no job was stopped and requeued by submitit on SLURM's USR2 at pre-emption")


def case_two_node(case: Case, reference: Path) -> None:
    """One cell on two nodes of one job, one rank each (``srun --overlap --mem=0 torchrun``, the
    job's memory tracked): the losses of one process, to 1e-4 (DDP sums in another order)."""
    verify(
        case,
        wait(case.start([*case.command(1), "--rows", "baseline"])),
        reference,
        rel=1e-4,
        rows=("baseline",),
    )


def case_driver_killed(case: Case, reference: Path) -> None:
    """The driver dies mid-cell; its jobs drain the queue; the same command then trains nothing
    and writes the whole table."""
    driver = case.start(case.command())
    first_checkpoint(case, [driver])
    driver.kill()
    driver.wait()
    deadline = time.monotonic() + 300
    while slurm("squeue", "-h", env=case.env()).strip() and time.monotonic() < deadline:
        time.sleep(1)
    (case.folder / "sweep.log").rename(case.folder / "killed-driver.log")
    verify(case, wait(case.start(case.command())), reference, jobs=False)
    if "2 cells, 0 to train, 2 finished earlier" not in case.log():
        case.fail(f"the command again did not find what the jobs finished: {case.log()[-600:]}")


CASES: dict[str, Callable[[Case, Path], None]] = {
    "micro": case_micro,
    "scancel": case_scancel,
    "requeue": case_requeue,
    "time-limit": case_time_limit,
    "preempt": lambda case, ref: case_preempt(case, ref, "batch"),
    "preempt-grace": lambda case, ref: case_preempt(case, ref, "grace", self_requeue=True),
    "preempt-usr2": case_preempt_usr2,
    "two-node": case_two_node,
    "driver-killed": case_driver_killed,
    "refusals": case_refusals,
    "refused-later": case_refused_later,
}


def reference_run(work: Path) -> Path:
    """The grid in one process on this machine (no SLURM): the losses every case must match."""
    folder = work / "reference"
    folder.mkdir()
    (folder / "slurm.yaml").write_text(GRID.replace("STEPS", str(STEPS)))
    results = folder / "results"
    command = [sys.executable, "-m", "sweep.cli", "sweep", "--grid", str(folder / "slurm.yaml")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.setdefault("GATED_ATTN_CACHE", str(ROOT / ".cache"))
    env.pop("MLFLOW_TRACKING_URI", None)
    done = subprocess.run([*command, "--results", str(results), "--workers", "1"], cwd=ROOT, env=env,
                          capture_output=True, text=True)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the one-process reference sweep exited {done.returncode}: {done.stdout[-800:]}")
    return results


#: slurmctld's log lines worth printing when a case fails (a launch refused, a job killed).
SLURM_ERRORS = re.compile(r"Killing|non-startable|revoked|Requeuing|drain|not responding|Invalid job")


def slurm_errors(log: Path, most: int = 20) -> list[str]:
    """The last ``most`` lines of slurmctld's ``log`` matching :data:`SLURM_ERRORS` ([] without one)."""
    if not log.exists():
        return []
    return [x for x in log.read_text(errors="replace").splitlines() if SLURM_ERRORS.search(x)][-most:]


def run_check(
    work: Path, names: list[str], out: Callable[[str], None] = print, record: Path | None = None
) -> int:
    """The cases ``names`` in ``work`` (each one's job readings into ``record``, a folder); the
    exit status (see the module docstring)."""
    t0 = time.perf_counter()
    say = lambda line: out(f"[{time.perf_counter() - t0:5.0f} s] {line}")  # noqa: E731
    reference = reference_run(work)
    say(f"reference: the grid in one process ({reference})")
    failures: list[str] = []
    with running(work / "cluster") as cluster:
        version = slurm("sinfo", "--version", env=cluster.env()).strip()
        say(f"{version}: {cluster.nodes} slurmd on this host, accounting by slurmdbd ({cluster.conf})")
        for name in names:
            long = GRID.replace("val_every: 200", "val_every: 4000")
            grid = {"two-node": TWO_NODE_GRID, "time-limit": long}.get(name, GRID)
            case = Case(name, work, cluster, grid, STEPS)
            started = time.perf_counter()
            try:
                with recording(cluster.env(), record / f"{name}.jsonl" if record else None):
                    CASES[name](case, reference)
            except (RuntimeError, OSError, subprocess.TimeoutExpired, StopIteration) as err:
                case.fail(f"{type(err).__name__}: {err}")
            finally:
                slurm("scancel", "-u", "root", env=cluster.env())  # nothing of a case outlives it
            failures += case.failures
            verdict = "FAIL" if case.failures else "ok"
            say(f"{name}: {verdict} in {time.perf_counter() - started:.0f} s{case.note and ': ' + case.note}")
        slurmctld = slurm_errors(cluster.log("slurmctld-own")) if failures else []
    for line in failures:
        out(f"FAIL: {line}")
    for line in slurmctld:  # CI keeps no folder: what SLURM itself refused or killed goes into the output
        out(f"slurmctld: {line}")
    if not failures:
        say(f"slurm check passed: {len(names)} cases")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.slurm_check [--keep] [--cases a,b]``; see the module docstring."""
    parser = argparse.ArgumentParser(prog="python -m tools.slurm_check", description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (logs, stores)")
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument(
        "--record", type=Path, default=None, help="a folder: every job reading, a file a case"
    )
    args = parser.parse_args(argv)
    names = [n for n in args.cases.split(",") if n]
    if unknown := [n for n in names if n not in CASES]:
        print(
            f"error: --cases: unknown {', '.join(unknown)}; choose from {', '.join(CASES)}", file=sys.stderr
        )
        return 2
    # SIGTERM (CI's timeout) unwinds like Ctrl-C: the cluster is stopped and the folder removed
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with it ignored (&)
    signal.signal(signal.SIGTERM, interrupt)
    work = Path(tempfile.mkdtemp(prefix="gated-slurm-"))
    try:
        install()
        if args.record:
            args.record.mkdir(parents=True, exist_ok=True)
        code = run_check(work, names, record=args.record)
    except ClusterError as err:
        print(f"slurm check: cannot run: {err}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:  # the cluster is stopped already (running's finally)
        print("slurm check: interrupted", file=sys.stderr)
        code = 130
    if code or args.keep:
        print(f"kept {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
