"""The cluster launcher's refusals: a launcher number out of range, or a job SLURM refuses, is one
line and exit 2, before anything is enqueued or submitted where SLURM can tell; a job refused
after others were submitted cancels them, and the next sweep trains every cell once.

SLURM here is a stand-in (:data:`FAKE`: ``srun``, ``sbatch``, ``scontrol``, ``scancel`` on the
PATH) whose lines are those SLURM 22.05 printed on ``make slurm-check``'s cluster (the
``refusals`` and ``refused-later`` cases run the same against the real one)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from mlflow import MlflowClient

from sweep.cli import main
from sweep.cli_parser import parser
from sweep.grid import load_grid
from sweep.run.slurm import REQUEUE_BOUND, launcher_for
from sweep.run.slurm_submit import said, slurm_minutes
from tests.support import MICRO, ROOT, all_cell_runs, queue_trials

pytest.importorskip("submitit", reason="the cluster launcher needs submitit (a core dependency)")

#: ``scontrol -o show partition`` on make slurm-check's cluster (cut to the fields read).
PARTITIONS = {
    "batch": "PartitionName=batch AllowAccounts=ALL Default=YES GraceTime=0 MaxNodes=UNLIMITED "
    "MaxTime=UNLIMITED MinNodes=0 Nodes=n[1-2] State=UP TotalCPUs=4 TotalNodes=2",
    "short": "PartitionName=short AllowAccounts=ALL Default=NO GraceTime=0 MaxNodes=UNLIMITED "
    "MaxTime=00:05:00 MinNodes=0 Nodes=n[1-2] State=UP TotalCPUs=4 TotalNodes=2",
}
#: What sbatch printed there, refusing: an account it does not know, a second job over
#: ``MaxSubmitJobs=1`` (after ``--test-only`` of the first said yes).
NO_ACCOUNT = (
    "allocation failure: Invalid account or account/partition combination specified\n",
    "sbatch: error: Batch job submission failed: Invalid account or account/partition combination "
    "specified\n",
)
OVER_LIMIT = (
    "sbatch: error: AssocMaxSubmitJobLimit\n"
    "sbatch: error: Batch job submission failed: Job violates accounting/QOS policy (job submit limit, "
    "user's size and/or time limits)\n"
)

#: One stand-in for SLURM's commands, told apart by the name it is called by; its answers come
#: from ``config.json`` beside it, and it writes each call to ``calls``.
FAKE = """\
import json, os, sys
here = os.path.dirname(os.path.abspath(__file__))
config = json.load(open(os.path.join(here, "config.json")))
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
with open(os.path.join(here, "calls"), "a") as f:
    f.write(json.dumps([name, *args]) + "\\n")
if name == "scontrol" and args[:3] == ["-o", "show", "partition"]:
    rows = config["partitions"]
    if args[3:] and args[3] not in rows:
        print(f"Partition {args[3]} not found")
        sys.exit(1)
    print("\\n".join(rows[p] for p in (args[3:] or rows)))
elif name == "sbatch" and args[0] == "--test-only":
    sys.stderr.write(config.get("test_only", "sbatch: Job 1 to start at now on n1\\n"))
    sys.exit(1 if "test_only" in config else 0)
elif name == "sbatch":
    calls = [json.loads(x) for x in open(os.path.join(here, "calls"))]
    n = sum(c[0] == "sbatch" and c[1] != "--test-only" for c in calls)
    if n > config.get("accept", 99):
        sys.stderr.write(config["refusal"])
        sys.exit(1)
    print(f"Submitted batch job {100 + n}")
"""


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write the stand-in's ``config.json`` (the function returned) and put it on the PATH;
    the function returns the calls so far, each as its argv."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "fake.py").write_text(FAKE)
    for name in ("srun", "sbatch", "scontrol", "scancel"):
        (bin_dir / name).write_text(f"#!{sys.executable}\nexec(open({str(bin_dir / 'fake.py')!r}).read())\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")

    def configure(**config) -> list[list[str]]:
        (bin_dir / "config.json").write_text(json.dumps({"partitions": PARTITIONS, **config}))
        calls = bin_dir / "calls"
        return [json.loads(x) for x in calls.read_text().splitlines()] if calls.exists() else []

    return configure


def sweep_args(tmp_path: Path, *extra: str) -> list[str]:
    grid = tmp_path / "micro.yaml"
    grid.write_text(MICRO)
    args = ["sweep", "--grid", str(grid), "--results", str(tmp_path / "results"), "--rows", "baseline"]
    return [*args, "--seeds", "1", "--launcher", "slurm", "--workers", "2", "--gpus-per-worker", "0", *extra]


def submissions(calls: list[list[str]]) -> list[list[str]]:
    return [c for c in calls if c[0] == "sbatch" and c[1] != "--test-only"]


def test_slurm_durations_read_as_minutes() -> None:
    cases = {"UNLIMITED": None, "5": 5, "30:00": 30, "00:05:00": 5, "4:00:00": 240, "1-00:00:00": 1440,
             "2-12": 3600, "1-2:30": 1590, "90:30": 90.5}  # fmt: skip
    assert {text: slurm_minutes(text) for text in cases} == cases
    with pytest.raises(ValueError):
        slurm_minutes("soon")


def test_what_sbatch_said_is_one_line_with_the_reason_first() -> None:
    assert said(NO_ACCOUNT[1]) == "Invalid account or account/partition combination specified"
    assert said(OVER_LIMIT) == (
        "Job violates accounting/QOS policy (job submit limit, user's size and/or time limits) "
        "(AssocMaxSubmitJobLimit)"
    )


@pytest.mark.parametrize(
    ("extra", "line"),
    [
        (["--gpus-per-worker", "-1"], "--gpus-per-worker -1: GPUs per job and node, 0 or more (0 for cells "
         "on CPUs; unset: the cells' train.devices)"),
        (["--cpus-per-worker", "0"], "--cpus-per-worker 0: CPUs per job, 1 or more"),
        (["--cpus-per-worker", "-4"], "--cpus-per-worker -4: CPUs per job, 1 or more"),
        (["--max-requeues", "-1"], "--max-requeues -1: time-limit requeues of a job, 0 or more (0: a job "
         "stops at its first time limit)"),
        (["--time-limit", "3"], "--time-limit 3: a job is warned 90 s before its limit (--signal=USR2@90), "
         "SLURM may send it up to 60 s earlier, and the job needs 90 s before that to start and train: give "
         "TIME_LIMIT=4 minutes or more"),
    ],
)  # fmt: skip
def test_a_launcher_number_out_of_range_is_one_line_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture, extra: list[str], line: str
) -> None:
    assert main(sweep_args(tmp_path, *extra)) == 2  # no SLURM here: refused before it is looked for
    assert capsys.readouterr().err == f"error: {line}\n"
    assert not (tmp_path / "results").exists()


def test_no_gpu_a_job_is_refused_for_rows_planned_for_gpus_and_taken_for_cells_on_cpus(
    tmp_path: Path, capsys: pytest.CaptureFixture, fake_slurm
) -> None:
    fake_slurm()
    args = ["sweep", "--grid", str(ROOT / "grids" / "table1.yaml"), "--scale", "paper", "--launcher", "slurm"]
    code = main([*args, "--workers", "2", "--gpus-per-worker", "0", "--results", str(tmp_path / "r")])
    assert code == 2
    assert capsys.readouterr().err == (
        "error: --gpus-per-worker 0: row baseline and 15 more trains on GPUs (train.gpu_memory_gib is set): "
        "give GPUS_PER_WORKER=8, or leave it unset\n"
    )
    assert not any((tmp_path / "r").rglob("*.db"))
    args = parser().parse_args(sweep_args(tmp_path, "--max-requeues", "7"))
    cells = load_grid(args.grid).cells("tiny", seeds=[0], rows=["baseline"])  # no gpu_memory_gib: CPUs
    launcher = launcher_for(args, cells)
    assert launcher.settings.gpus_per_worker == 0
    assert launcher.executor._executor.max_num_timeout == 7  # MAX_REQUEUES is submitit's bound
    script = launcher.executor._executor._make_submission_file_text("python", "uid")
    assert "--gpus-per-node" not in script and "#SBATCH --requeue" in script


@pytest.mark.parametrize(
    ("extra", "config", "line"),
    [
        (["--partition", "nope"], {}, "--partition nope: SLURM says: Partition nope not found"),
        (["--partition", "short", "--time-limit", "10"], {}, "--time-limit 10: partition short lets a job "
         "run 5 minutes at most (its MaxTime): give TIME_LIMIT=5 or less, or another PARTITION"),
        ([], {"test_only": NO_ACCOUNT[0]}, "sbatch refuses the workers' jobs: Invalid account or "
         "account/partition combination specified; nothing was submitted"),
    ],
)  # fmt: skip
def test_a_job_slurm_refuses_is_one_line_before_anything_is_enqueued_or_submitted(
    tmp_path: Path, capsys: pytest.CaptureFixture, fake_slurm, extra: list[str], config: dict, line: str
) -> None:
    fake_slurm(**config)
    assert main(sweep_args(tmp_path, *extra)) == 2
    assert capsys.readouterr().err == f"error: {line}\n"
    assert not any((tmp_path / "results").rglob("*.db"))  # no store, no queue
    assert submissions(fake_slurm(**config)) == []


def test_a_second_job_refused_cancels_the_first_and_the_next_sweep_trains_every_cell_once(
    tmp_path: Path, capsys: pytest.CaptureFixture, fake_slurm, repo_cache: None
) -> None:
    fake_slurm(accept=1, refusal=OVER_LIMIT)
    assert main(sweep_args(tmp_path)) == 2
    assert capsys.readouterr().err == (
        "error: sbatch refused job 2 of 2: Job violates accounting/QOS policy (job submit limit, user's size "
        "and/or time limits) (AssocMaxSubmitJobLimit); cancelled the 1 submitted before it (101); the cells "
        "stay queued for the next sweep\n"
    )
    calls = fake_slurm(accept=1, refusal=OVER_LIMIT)
    assert len(submissions(calls)) == 2 and ["scancel", "101"] in calls
    jobs = tmp_path / "results" / "slurm"
    assert sorted(p.name for p in jobs.iterdir() if p.is_file() and not p.is_symlink()) == []
    trials = queue_trials(tmp_path / "results")
    assert [(t.state.name, t.user_attrs["row"]) for t in trials] == [("WAITING", "baseline")]

    local = sweep_args(tmp_path)[: sweep_args(tmp_path).index("--launcher")]  # one local worker
    assert main(local) == 0
    runs = all_cell_runs(tmp_path / "results")
    assert [r.data.tags["status"] for r in runs] == ["finished"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'results' / 'mlflow.db'}")
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss")]
    assert Counter(steps) == Counter(range(8))  # each step once
    assert len(queue_trials(tmp_path / "results")) == 1  # the queued trial trained it, none added


def test_the_requeue_bound_is_what_a_job_returns_when_submitit_stops_requeueing_it() -> None:
    from submitit.core.utils import UncompletedJobError

    from sweep.run.slurm import WorkerJob

    class Bounded(WorkerJob):
        def _run(self) -> int:
            raise UncompletedJobError("Job not requeued because: timed-out too many times.")

    class Other(WorkerJob):
        def _run(self) -> int:
            raise UncompletedJobError("Job not requeued because: checkpoint function returned None.")

    assert Bounded(["true"], ".", {}, max_requeues=5)() == REQUEUE_BOUND
    with pytest.raises(UncompletedJobError):
        Other(["true"], ".", {})()
