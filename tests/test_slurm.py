"""The cluster launcher through submitit's LocalExecutor: the jobs drain the queue, and a job
pre-empted mid-cell is requeued while its cell resumes from its checkpoint, trained once."""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import optuna
import psutil
import pytest
import torch.distributed as dist
from mlflow import MlflowClient

from sweep.cli import main
from sweep.grid import load_grid
from sweep.run import slurm_jobs
from sweep.run.queue import enqueue_cells, open_queue
from sweep.run.runner import prepare_sweep
from sweep.run.slurm import (
    SIGNAL_MARGIN_S,
    ClusterSettings,
    LauncherError,
    SubmititLauncher,
    gpus_per_job,
    make_executor,
)
from sweep.signals import StopRequest
from sweep.studies import storage_url
from tests.support import (
    LONG_MICRO,
    LONG_STEPS,
    MICRO,
    ROOT,
    SLOW_CLI,
    all_cell_runs,
    assert_close,
    histories,
    queue_trials,
    wait_for_checkpoint,
    weights,
)

GLOO = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend")
pytest.importorskip("submitit", reason="the cluster launcher needs submitit (a core dependency)")

ROWS = ["baseline", "sdpa_elementwise"]  # two rows, two seeds: four cells


def preempt(how: str, job: int, worker: int) -> None:
    """``usr2``: submitit's signal (a time limit, or a cluster's pre-emption notice) to the job.
    ``sigterm``: SLURM's pre-emption or ``scancel``, SIGTERM to every process of the job, SIGKILL
    to any left after a grace time."""
    if how.startswith("usr2"):
        os.kill(job, signal.SIGUSR2)
        return
    procs = [psutil.Process(job), psutil.Process(worker)]
    for p in procs:
        p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=30)
    for p in alive:
        p.kill()


@pytest.mark.slow  # make test-all: processes, signals, faults
@pytest.mark.parametrize("how", ["usr2", "usr2_to_job_id", "sigterm"])
def test_two_jobs_drain_four_cells_and_a_preempted_jobs_cell_resumes_trained_once(
    repo_cache: None, tmp_path: Path, how: str
) -> None:
    """Pre-empted by submitit's signal, the job is requeued (by submitit) and runs a worker
    again; pre-empted by SIGTERM, it ends (SLURM requeues it where the partition says so). Either
    way the cell resumes in its own run, and every cell is trained once."""
    grid_path = tmp_path / "micro.yaml"
    grid_path.write_text(LONG_MICRO)
    results = tmp_path / "results"
    results.mkdir()
    grid = load_grid(grid_path)
    cells = grid.cells("tiny", seeds=[0, 1], rows=ROWS)
    ctx = prepare_sweep(grid, cells, results, ROOT / ".cache", out=lambda _line: None)
    url = storage_url(results, None)
    assert len(enqueue_cells(open_queue("tiny", url, 1), cells, ctx, force=False)) == 4

    worker = [sys.executable, "-c", SLOW_CLI, "worker", "--grid", str(grid_path), "--results"]
    worker += [str(results), "--storage", url, "--heartbeat", "1", "--seeds", "2", "--rows", ",".join(ROWS)]
    settings = ClusterSettings("submitit-local", tmp_path / "jobs", gpus_per_worker=0, time_limit_min=30)
    launcher, lines, stop = SubmititLauncher(settings, poll_s=0.5), [], StopRequest()
    driver = threading.Thread(target=launcher, args=(worker, 2, stop, lines.append, {}))
    started = time.monotonic()
    driver.start()
    try:
        while len(launcher.jobs) < 2:
            time.sleep(0.1)
        jobs = list(launcher.jobs)
        folder = wait_for_checkpoint(results, 15, [j._process for j in jobs])
        (run,) = [r for r in all_cell_runs(results) if r.info.run_id == folder.name]
        pid = int(run.data.tags["worker"].rsplit(":", 1)[1])
        job_process = psutil.Process(pid).parent()  # the submitit task that runs this worker
        (victim,) = [j for j in jobs if job_process.ppid() == j._process.pid]
        # usr2_to_job_id: to the job id the driver prints (submitit-local's controller, whose
        # default action kills it and leaves its task); usr2: to the job's task, as SLURM does
        preempt(how, job_process.ppid() if how == "usr2_to_job_id" else job_process.pid, pid)
        driver.join(timeout=600)
        assert not driver.is_alive(), "the jobs did not end within 10 minutes"
    finally:
        for job in launcher.jobs:  # emptied once they have all ended
            if not job.done():
                job.cancel(check=False)
    print(f"4 cells, 2 jobs, one pre-empted: {time.monotonic() - started:.0f} s")

    assert lines[0].startswith("submitted 2 submitit-local jobs")
    ends = {j.job_id: f"job {j.job_id} ended FINISHED" for j in jobs}  # each job's end, once
    if how == "usr2_to_job_id":  # the controller died of it: said, and its worker left saved
        logs = f"its log: {victim.paths.stdout} (errors: {victim.paths.stderr})"
        ends[victim.job_id] = f"job {victim.job_id} ended INTERRUPTED; {logs}"
    assert sorted(lines[1:]) == sorted(ends.values())
    log = victim.paths.stdout.read_text() + victim.paths.stderr.read_text()
    if how == "usr2":
        assert "pre-emption or time limit: stopping the worker" in log
        assert "Requeued job" in log  # submitit put the job back, and it ran again
        assert log.count("Starting with JobEnvironment") == 2
    else:
        assert "worker stopped by a signal (status 143); its cell is back in the queue" in log
        assert "Requeued job" not in log and log.count("Starting with JobEnvironment") == 1

    runs = all_cell_runs(results)
    assert Counter(r.data.tags["run_key"] for r in runs) == Counter(c.run_key for c in cells)
    assert {r.data.tags["status"] for r in runs} == {"finished"}
    (resumed,) = [r for r in runs if r.data.tags.get("resumed") == "1"]
    assert resumed.info.run_id == folder.name
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    for r in runs:  # every step trained once, the pre-empted cell's across two workers
        steps = [m.step for m in client.get_metric_history(r.info.run_id, "train/loss")]
        assert sorted(steps) == list(range(LONG_STEPS)), r.data.tags["run_key"]

    trials = queue_trials(results)
    outcomes = Counter(t.user_attrs["outcome"] for t in trials)
    assert outcomes == {"finished": 3, "killed": 1, "resumed": 1}
    (killed,) = [t for t in trials if t.user_attrs["outcome"] == "killed"]
    assert killed.user_attrs["run_key"] == resumed.data.tags["run_key"]
    assert killed.state == optuna.trial.TrialState.FAIL


@pytest.mark.slow  # make test-all: processes, signals
def test_a_job_past_max_requeues_stops_saved_says_so_and_the_next_sweep_resumes_its_cell(
    repo_cache: None, tmp_path: Path
) -> None:
    """submitit-local, a job of 2 minutes (warned after 90 s) allowed no time-limit requeue
    (``MAX_REQUEUES=0``): at its warning the worker stops, saved, submitit does not requeue the
    job, which ends and says so in one line; the cell waits in the queue, and the next sweep
    resumes it in its own run, every step once."""
    steps = 1200  # two minutes of slowed steps at least: longer than the job
    grid_path = tmp_path / "micro.yaml"
    grid_path.write_text(LONG_MICRO.replace(f"max_steps: {LONG_STEPS},", f"max_steps: {steps},"))
    results = tmp_path / "results"
    results.mkdir()
    grid = load_grid(grid_path)
    cells = grid.cells("tiny", seeds=[0], rows=["baseline"])
    ctx = prepare_sweep(grid, cells, results, ROOT / ".cache", out=lambda _line: None)
    url = storage_url(results, None)
    assert len(enqueue_cells(open_queue("tiny", url, 1), cells, ctx, force=False)) == 1
    worker = [sys.executable, "-c", SLOW_CLI, "worker", "--grid", str(grid_path), "--results"]
    worker += [str(results), "--storage", url, "--heartbeat", "1", "--seeds", "1", "--rows", "baseline"]
    settings = ClusterSettings(
        "submitit-local", tmp_path / "jobs", gpus_per_worker=0, time_limit_min=2, max_requeues=0
    )
    launcher, lines = SubmititLauncher(settings, poll_s=0.5), []
    launcher(worker, 1, StopRequest(), lines.append, {})

    job_id = lines[0].split("(")[1].split(")")[0]
    assert lines[1:] == [
        f"job {job_id} ended FINISHED",
        f"job {job_id} stopped at its time limit after MAX_REQUEUES=0 requeues: its cell is saved and "
        "queued; the same command again resumes it",
    ]
    log = (tmp_path / "jobs" / job_id / f"{job_id}_0_log.out").read_text()
    assert "Job not requeued because: timed-out too many times." in log
    assert log.count("Starting with JobEnvironment") == 1
    (killed,) = all_cell_runs(results)
    assert killed.data.tags["status"] == "killed"
    assert Counter(t.state.name for t in queue_trials(results)) == {"FAIL": 1, "WAITING": 1}

    args = [
        "sweep",
        "--grid",
        str(grid_path),
        "--results",
        str(results),
        "--seeds",
        "1",
        "--rows",
        "baseline",
    ]
    assert main(args) == 0
    (run,) = all_cell_runs(results)
    assert run.info.run_id == killed.info.run_id and run.data.tags["resumed"] == "1"
    assert run.data.tags["status"] == "finished"
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == list(
        range(steps)
    )


def test_the_slurm_job_asks_for_the_partition_gpus_time_and_a_requeue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sbatch script submitit would submit (no cluster needed to write it)."""
    import submitit

    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # "srun is here"
    settings = ClusterSettings("slurm", tmp_path, partition="gpu", gpus_per_worker=2, time_limit_min=90)
    executor = make_executor(settings)
    script = executor._executor._make_submission_file_text("python -m sweep.cli worker", "uid")
    assert executor._executor.max_num_timeout == settings.max_requeues == 30  # MAX_REQUEUES, not submitit's 3
    for flag in (
        "--partition=gpu",
        "--gpus-per-node=2",
        "--time=90",
        "--requeue",
        f"--signal=USR2@{SIGNAL_MARGIN_S}",
    ):
        assert f"#SBATCH {flag}" in script
    cpu = make_executor(ClusterSettings("slurm", tmp_path, gpus_per_worker=0))
    assert "--gpus-per-node" not in cpu._executor._make_submission_file_text("python", "uid")


def test_the_cluster_launcher_needs_a_number_of_workers_and_srun(
    repo_cache: None, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["sweep", "--launcher", "slurm", "--workers", "auto"]) == 2
    assert "--launcher slurm needs --workers N" in capsys.readouterr().err
    if shutil.which("srun") is None:  # one line, and nothing trained
        assert main(["sweep", "--launcher", "slurm", "--workers", "2", "--results", str(tmp_path)]) == 2
        assert (
            capsys.readouterr().err
            == 'error: --launcher slurm: Could not detect "srun", are you indeed on a slurm cluster?\n'
        )
        assert not (tmp_path / "mlflow.db").exists()


def test_a_two_node_job_asks_slurm_for_two_nodes_of_one_task(tmp_path: Path, monkeypatch) -> None:
    import submitit

    monkeypatch.setattr(submitit.SlurmExecutor, "affinity", classmethod(lambda cls: 1))  # "srun is here"
    executor = make_executor(ClusterSettings("slurm", tmp_path, gpus_per_worker=8, nodes=2))
    script = executor._executor._make_submission_file_text("python -m sweep.cli worker", "uid")
    for flag in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8"):
        assert f"#SBATCH {flag}" in script


def test_a_job_gets_a_gpu_for_each_rank_of_its_cells() -> None:
    assert gpus_per_job(None, 8) == 8  # GPUS_PER_WORKER unset: the cells' train.devices
    assert gpus_per_job(None, 1) == 1
    assert gpus_per_job(0, 8) == 0  # no GPUs asked for: gloo ranks on CPUs
    assert gpus_per_job(8, 8) == 8 and gpus_per_job(16, 8) == 16
    with pytest.raises(LauncherError, match=r"^--gpus-per-worker 4: the cells train on 8 devices a node"):
        gpus_per_job(4, 8)
    with pytest.raises(LauncherError, match=r"^--gpus-per-worker -1: GPUs per job and node, 0 or more$"):
        gpus_per_job(-1, 1)
    assert gpus_per_job(0, 1, []) == 0  # cells on CPUs
    with pytest.raises(LauncherError, match=r"^--gpus-per-worker 0: row baseline trains on GPUs"):
        gpus_per_job(0, 8, ["baseline"])


def test_the_paper_rows_on_one_gpu_a_job_are_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # Table 1's paper rows train on 8 GPUs a node: a job of one GPU would put 8 ranks on it.
    args = ["sweep", "--grid", str(ROOT / "grids" / "table1.yaml"), "--scale", "paper", "--launcher", "slurm"]
    code = main([*args, "--workers", "2", "--gpus-per-worker", "1", "--results", str(tmp_path / "r")])
    assert code == 2
    assert capsys.readouterr().err == (
        "error: --gpus-per-worker 1: the cells train on 8 devices a node (train.devices), one GPU a rank: "
        "give GPUS_PER_WORKER=8, or leave it unset\n"
    )
    assert not any((tmp_path / "r").rglob("*.db"))


def test_a_cell_on_two_nodes_is_refused_without_a_cluster_launcher(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = tmp_path / "micro.yaml"
    path.write_text(MICRO.replace("expert_dim: 16}}}", "expert_dim: 16}}, train: {num_nodes: 2}}"))
    code = main(["sweep", "--grid", str(path), "--results", str(tmp_path / "results")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == (
        f"error: {path}: row 'moe': train.num_nodes: num_nodes = 2: a cell on several machines trains "
        "in a cluster job of as many nodes (LAUNCHER=slurm, or submitit-local to try it here)"
    )
    args = [
        "sweep",
        "--grid",
        str(path),
        "--results",
        str(tmp_path / "results"),
        "--launcher",
        "submitit-local",
    ]
    assert main([*args, "--workers", "1"]) == 2  # one job size per sweep: 1 and 2 nodes mixed
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"error: {path}: row 'baseline': train.num_nodes: num_nodes = 1, but row 'moe' has 2"
    )
    assert not (tmp_path / "results").exists()


@pytest.mark.slow
@GLOO
def test_a_moe_cell_on_two_nodes_of_one_job_trains_as_in_one_process(
    tmp_path: Path, repo_cache: None
) -> None:
    """``train: {num_nodes: 2, strategy: ddp}`` through ``--launcher submitit-local``: one job whose
    worker starts two torchrun "nodes" of one gloo rank each here, meeting at one c10d
    rendezvous (in a SLURM job: one ``srun`` of torchrun over its nodes). Its run holds every
    metric of the one-process run, each step once, with the same values (but wall-clock
    figures), and its final weights."""
    two_nodes = MICRO.replace("max_lr: 2e-3}", "max_lr: 2e-3, num_nodes: 2, strategy: ddp}")
    found = {}
    for name, text, extra in (
        ("one", MICRO, []),
        ("two", two_nodes, ["--launcher", "submitit-local", "--workers", "1", "--gpus-per-worker", "0"]),
    ):
        (tmp_path / name).mkdir()
        grid = tmp_path / name / "grid.yaml"
        grid.write_text(text)
        results = tmp_path / name / "results"
        assert main(["sweep", "--grid", str(grid), "--results", str(results), "--rows", "moe", *extra]) == 0
        found[name] = histories(results)
    one, two = found["one"], found["two"]
    assert one.keys() == two.keys() and "train/loss" in one
    for key in {k for k in one if not k.startswith("system/")} - {"train/tokens_per_s"}:
        assert [s for s, _ in two[key]] == [s for s, _ in one[key]], key
        assert [v for _, v in two[key]] == pytest.approx([v for _, v in one[key]], rel=1e-4, abs=1e-6), key
    finals = [next((tmp_path / n / "results" / "checkpoints").glob("*/*/final.ckpt")) for n in ("one", "two")]
    assert_close(weights(finals[1]), weights(finals[0]))


def test_a_time_limit_too_short_for_the_warning_and_some_training_is_refused_before_submission(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from sweep.run.slurm import check_time_limit

    check_time_limit(4)  # 90 s before the warning, were it sent 60 s early: allowed
    with pytest.raises(LauncherError) as refused:
        check_time_limit(3)  # a 3-minute job of make slurm-check was warned after 65 s
    assert str(refused.value) == (
        "--time-limit 3: a job is warned 90 s before its limit (--signal=USR2@90), SLURM may send it up "
        "to 60 s earlier, and the job needs 90 s before that to start and train: give TIME_LIMIT=4 minutes "
        "or more"
    )
    args = ["sweep", "--launcher", "submitit-local", "--workers", "1", "--time-limit", "1"]
    assert main([*args, "--results", str(tmp_path / "results")]) == 2
    assert capsys.readouterr().err.startswith("error: --time-limit 1: a job is warned 90 s")
    assert not (tmp_path / "results").exists()  # nothing submitted, nothing written


#: ``scontrol -o show job 7`` as SLURM 22.05 prints it (cut to the fields read, in their order).
SCONTROL = (
    "JobId=7 JobName=gated-attn-worker UserId=root(0) JobState={state} Reason={reason} Dependency=(null) "
    "Requeue=1 Restarts={restarts} BatchFlag=1 Reboot=0 ExitCode={code} RunTime=00:00:06 "
    "PreemptEligibleTime=2026-12-05T09:19:28 PreemptTime={preempt} SuspendTime=None Partition=batch\n"
)


class FakeSlurm:
    """Answers ``scontrol -o show job``, ``scontrol show config`` and ``sacct`` from a script of
    readings: one per poll, the last repeated."""

    def __init__(self, readings: list[dict | None], sacct: str | None = "7|COMPLETED|0:0\n", accounting=True):
        self.readings, self.sacct, self.accounting, self.calls = readings, sacct, accounting, []

    def __call__(self, command: list[str]):
        import subprocess

        self.calls.append(command[0])
        done = lambda out, code=0, err="": subprocess.CompletedProcess(command, code, out, err)  # noqa: E731
        if command[:3] == ["scontrol", "show", "config"]:
            kind = "accounting_storage/slurmdbd" if self.accounting else "accounting_storage/none"
            return done(f"AccountingStorageHost   = localhost\nAccountingStorageType   = {kind}\n")
        if command[0] == "sacct":
            return (
                done(self.sacct) if self.accounting else done("", 1, "Slurm accounting storage is disabled")
            )
        reading = self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]
        if reading == "down":
            return done("", 1, "slurm_load_jobs error: Socket timed out on send/recv operation")
        if reading is None:
            return done("", 1, "slurm_load_jobs error: Invalid job id specified")
        fields = {"reason": "None", "restarts": 0, "code": "0:0", "preempt": "None", **reading}
        return done(SCONTROL.format(**fields))


def follow(monkeypatch: pytest.MonkeyPatch, fake: FakeSlurm, polls: int = 20) -> tuple[list[str], int]:
    """Poll a watch of job 7 until it says ended (or ``polls`` run out): its lines, its polls."""
    monkeypatch.setattr(slurm_jobs, "_run", fake)
    lines: list[str] = []
    watch = slurm_jobs.JobWatch(["7"], lines.append)
    for n in range(1, polls + 1):
        if watch.poll():
            lines.append(f"ended {watch.last['7'].describe()}")
            return lines, n
    return lines, polls


def test_the_driver_follows_a_job_through_its_requeue_until_slurm_says_it_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pre-empted (or ``scontrol requeue``): COMPLETING, then PENDING on its BeginTime, then
    RUNNING again; only COMPLETED ends it, and the last line is SLURM's."""
    readings = [
        {"state": "PENDING", "reason": "Priority"},
        {"state": "RUNNING"},
        {"state": "COMPLETING", "restarts": 1},
        {"state": "PENDING", "reason": "BeginTime", "restarts": 1},
        "down",  # slurmctld busy: nothing is concluded from a query not answered
        {"state": "RUNNING", "restarts": 1},
        {"state": "COMPLETED", "restarts": 1},
    ]
    lines, polls = follow(monkeypatch, FakeSlurm(readings))
    assert polls == 7
    assert lines == [
        "job 7: PENDING (Priority)",
        "job 7: RUNNING",
        "job 7: requeued (run 2)",
        "job 7: COMPLETING (requeued 1 time)",
        "job 7: PENDING (BeginTime, requeued 1 time)",
        "job 7: RUNNING (requeued 1 time)",
        "ended COMPLETED (exit 0:0, requeued 1 time), from scontrol",
    ]


def test_a_job_slurmctld_let_go_is_read_from_sacct_and_without_accounting_one_line_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gone = [{"state": "RUNNING"}, None]  # then MinJobAge passed: scontrol forgot it
    lines, _ = follow(monkeypatch, FakeSlurm(gone, sacct="7|CANCELLED by 0|0:15\n"))
    assert lines[-1] == "ended CANCELLED (exit 0:15), from sacct"
    fake = FakeSlurm([{"state": "RUNNING"}, {"state": "RUNNING"}, None], accounting=False)
    lines, polls = follow(monkeypatch, fake)
    assert lines == [
        "SLURM accounting is off on this cluster (AccountingStorageType=accounting_storage/none): job "
        "states come from scontrol while slurmctld keeps a job (MinJobAge after its end)",
        "job 7: RUNNING",
        "ended UNKNOWN",
    ]
    assert polls == 3 and "sacct" not in fake.calls  # said once, never asked again


def test_a_job_preempted_for_good_ends_once_seen_twice_and_a_requeued_one_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import time

    monkeypatch.setattr(time, "sleep", lambda s: None)
    clock = iter(range(0, 1000, 2))  # two seconds a poll
    monkeypatch.setattr(slurm_jobs.time, "monotonic", lambda: next(clock))
    for_good = [{"state": "RUNNING"}, {"state": "PREEMPTED", "code": "0:15"}]
    lines, polls = follow(monkeypatch, FakeSlurm(for_good))
    assert polls == 3 and lines[-1] == "ended PREEMPTED (exit 0:15), from scontrol"
    requeued = [{"state": "RUNNING"}, {"state": "PREEMPTED"}, {"state": "PENDING", "restarts": 1}]
    lines, polls = follow(monkeypatch, FakeSlurm([*requeued, {"state": "COMPLETED", "restarts": 1}]))
    assert "job 7: requeued (run 2)" in lines and lines[-1].startswith("ended COMPLETED")


def test_a_job_requeues_itself_only_when_preempted_with_a_grace_time(monkeypatch: pytest.MonkeyPatch) -> None:
    for reading, grace in (
        ({"state": "RUNNING", "preempt": "2026-12-05T09:08:44"}, True),  # SIGTERM at the grace's start
        ({"state": "RUNNING"}, False),  # a signal sent by hand
        ({"state": "COMPLETING", "preempt": "2026-12-05T09:08:44"}, False),  # no grace: SLURM requeues
        ({"state": "CANCELLED"}, False),  # scancel
        (None, False),
        ("down", False),
    ):
        monkeypatch.setattr(slurm_jobs, "_run", FakeSlurm([reading]))
        assert slurm_jobs.preempted_with_grace("7") is grace, reading
