"""The cases of ``make slurm-check`` (:mod:`tools.slurm_check`) about SLURM's limits: a cell many
time limits long, sized from the step time measured just before it; the jobs SLURM refuses, and
the launcher's numbers out of range, each one line and exit 2 with nothing enqueued or submitted;
a second job refused after the first was submitted, then the same command run again.
"""

from __future__ import annotations

import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sweep.run.slurm import SIGNAL_EARLY_S, SIGNAL_MARGIN_S
from tools.servers_check import ROOT
from tools.slurm_case import ROWS, Case, first_checkpoint, releasing, slurm, verify, wait

TIME_LIMIT_MIN = 4  # the time-limit case's TIME_LIMIT: the least the launcher takes
#: A job of the case trains about TIME_LIMIT less the warning's 90 s, less 30 s (SLURM may send it
#: up to 60 s early), a start-up of 10-20 s within that: a 4-minute job was warned 132-136 s after
#: its start and trained 2,029-2,242 steps, at 45 ms a step measured before.
TRAIN_S = TIME_LIMIT_MIN * 60 - SIGNAL_MARGIN_S - SIGNAL_EARLY_S / 2
#: The time-limit case's cell spans this many jobs at the step time measured (more than five time
#: limits on a machine whose load holds still)...
PLANNED_LIMITS = 7
#: ... and fails with fewer runs than this: two requeues at least, whatever the load does. A load
#: that fell during the case once ran it 2.2 times faster than measured (37.9 ms a step measured
#: beside a table regeneration and a test run, 3 runs), which a bound of 6 runs (1.17 times)
#: failed; 7/3 = 2.3 times faster is what this bound takes.
LEAST_RUNS = 3
CALIBRATION_STEPS = 600  # the measuring run's steps (the case's grid, one process, no SLURM)
WINDOW = 50  # steps per window of the step time's median


def measure(case: Case, grid_text: str) -> float:
    """The case's cell trained in one process for :data:`CALIBRATION_STEPS` steps now, on this
    machine as loaded as it is: seconds a step, the median over windows of :data:`WINDOW` steps
    of ``train/loss``'s timestamps.

    Raises:
        RuntimeError: the measuring sweep failed.
    """
    from mlflow import MlflowClient

    folder = case.folder / "measure"
    folder.mkdir()
    grid = folder / "slurm.yaml"
    grid.write_text(grid_text.replace("STEPS", str(CALIBRATION_STEPS)))
    results = folder / "results"
    command = [sys.executable, "-m", "sweep.cli", "sweep", "--grid", str(grid), "--results", str(results)]
    done = subprocess.run([*command, "--rows", "baseline"], cwd=ROOT, env=case.env(), capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"the measuring sweep exited {done.returncode}: {done.stdout[-600:]}")
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()], "tags.kind = 'cell'")[0]
    stamps = sorted(
        (m.step, m.timestamp / 1000) for m in client.get_metric_history(run.info.run_id, "train/loss")
    )
    times = [t for _, t in stamps]
    windows = [(times[i + WINDOW] - times[i]) / WINDOW for i in range(0, len(times) - WINDOW, WINDOW)]
    return statistics.median(windows)


def planned_steps(step_s: float) -> int:
    """Steps for :data:`PLANNED_LIMITS` jobs of :data:`TRAIN_S` each at ``step_s`` a step, in hundreds."""
    return math.ceil(PLANNED_LIMITS * TRAIN_S / step_s / 100) * 100


def case_time_limit(case: Case, reference: Path | None) -> None:
    """One cell :data:`PLANNED_LIMITS` jobs of ``TIME_LIMIT=4`` long at the step time measured
    just before: each job warned before its limit (USR2), requeued by submitit, the cell resumed;
    it finishes in the one sweep, every step once, after at least two time limits (its note
    says how many: more than five where the load held still)."""
    grid_text = case.grid.read_text().replace(f"max_steps: {case.steps}", "max_steps: STEPS")
    step_s = measure(case, grid_text)
    case.steps = planned_steps(step_s)
    case.grid.write_text(grid_text.replace("STEPS", str(case.steps)))
    case.note = f"{case.steps} steps: {step_s * 1000:.1f} ms a step measured, {PLANNED_LIMITS} jobs planned"
    with releasing(case):
        command = case.command(1)
        command[command.index("--time-limit") + 1] = str(TIME_LIMIT_MIN)
        driver = case.start([*command, "--rows", "baseline"])
        run = first_checkpoint(case, [driver])
        code = wait(driver, PLANNED_LIMITS * TIME_LIMIT_MIN * 60 * 4)  # four times slower: stopped
    verify(case, code, None, {run.name}, rows=("baseline",))
    runs = max((int(n) for n in re.findall(r"requeued \(run (\d+)\)", case.log())), default=1)
    logs = "".join(p.read_text() for p in (case.results / "slurm").glob("*/*_log.out"))
    limits = len(re.findall(r"Caught signal SIGUSR2 .*: this job is timed-out", logs))
    case.note += f"; {limits} time limits, {runs} runs"
    if runs < LEAST_RUNS or limits < LEAST_RUNS - 1:
        case.fail(
            f"the cell spanned {runs} jobs ({limits} time limits): want {LEAST_RUNS} or more ({case.note})"
        )


#: What each refusal is: extra sweep arguments, extra environment, a part of the one line.
REFUSALS = {
    "a partition SLURM does not know": (["--partition", "nope"], {}, "Partition nope not found"),
    "an account SLURM does not know": ([], {"SBATCH_ACCOUNT": "nope"}, "Invalid account"),
    "TIME_LIMIT over the partition's MaxTime": (
        ["--partition", "short", "--time-limit", "10"],
        {},
        "partition short lets a job run 5 minutes at most",
    ),
    "more CPUs than a node has": (["--cpus-per-worker", "512"], {}, "Requested node configuration"),
    "GPUS_PER_WORKER=-1": (["--gpus-per-worker", "-1"], {}, "--gpus-per-worker -1: GPUs per job"),
    "CPUS_PER_WORKER=0": (["--cpus-per-worker", "0"], {}, "--cpus-per-worker 0: CPUs per job, 1 or more"),
    "CPUS_PER_WORKER=-4": (["--cpus-per-worker", "-4"], {}, "--cpus-per-worker -4: CPUs per job"),
    "MAX_REQUEUES=-1": (["--max-requeues", "-1"], {}, "--max-requeues -1: time-limit requeues"),
    "TIME_LIMIT=3": (["--time-limit", "3"], {}, "give TIME_LIMIT=4 minutes or more"),
}


def case_refusals(case: Case, reference: Path | None) -> None:
    """Each of :data:`REFUSALS`: exit 2, one line on stderr naming what is wrong, no traceback,
    no store or queue written, no job in SLURM's queue."""
    for what, (extra, env, expected) in REFUSALS.items():
        results = case.folder / re.sub(r"\W+", "-", what)
        command = case.command(2, *extra)
        command[command.index("--results") + 1] = str(results)
        done = subprocess.run(command, cwd=ROOT, env={**case.env(), **env}, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
        lines = done.stderr.strip().splitlines()
        stored = sorted(p.name for p in results.rglob("*.db")) if results.exists() else []
        queued = slurm("squeue", "-h", env=case.env()).strip()
        if done.returncode != 2 or len(lines) != 1 or expected not in done.stderr or stored or queued:
            case.fail(
                f"{what}: exit {done.returncode}, stderr {done.stderr.strip()[-400:]!r}, stores {stored}, "
                f"squeue {queued!r}: want exit 2, one line with {expected!r}, nothing written or queued"
            )


def case_refused_later(case: Case, reference: Path) -> None:
    """sbatch takes the first job and refuses the second (the account may have one job,
    ``MaxSubmitJobs=1``): the first is cancelled, the sweep ends in one line with exit 2, the
    cells stay queued. With the limit lifted, the same command trains every cell once."""
    sacctmgr = ["sacctmgr", "-i", "modify", "user", "root", "set"]
    slurm(*sacctmgr, "MaxSubmitJobs=1", env=case.env())
    try:
        time.sleep(2)  # slurmctld hears of the association's change from slurmdbd
        done = subprocess.run(case.command(2), cwd=ROOT, env=case.env(), capture_output=True, text=True,
                              timeout=300)  # fmt: skip
    finally:
        slurm(*sacctmgr, "MaxSubmitJobs=-1", env=case.env())
    lines = done.stderr.strip().splitlines()
    if done.returncode != 2 or len(lines) != 1 or "sbatch refused job 2 of 2" not in done.stderr:
        case.fail(f"exit {done.returncode}, stderr {done.stderr.strip()[-400:]!r}: want 2, one line")
    if slurm("squeue", "-h", "-t", "PD,R", env=case.env()).strip():
        case.fail("a job of the refused sweep is still in SLURM's queue")
    time.sleep(2)
    (case.folder / "sweep.log").write_text(done.stdout + done.stderr)
    (case.folder / "sweep.log").rename(case.folder / "refused.log")
    verify(case, wait(case.start(case.command(2))), reference, rows=ROWS)
