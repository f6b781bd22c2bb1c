"""Two processes on one store: a new store set up once, each cell trained once, and a summary that
says what each cell went through (finished, resumed, restarted, busy, killed, not started)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient
from mlflow.entities import ViewType

from sweep.cli import main
from sweep.grid import load_grid
from sweep.run.runner import CellResult
from sweep.run.summary import summary_line
from sweep.sqlite_lock import sqlite_file
from tests.support import LONG_MICRO, LONG_STEPS, MICRO, ROOT, start_slow_cli, use_repo_cache

pytestmark = pytest.mark.slow  # make test-all: processes, signals, faults

#: LONG_MICRO cut to 12 steps: checkpoints at steps 5 and 10.
SHORT_STEPS = 12
SHORT_MICRO = LONG_MICRO.replace(f"max_steps: {LONG_STEPS}", f"max_steps: {SHORT_STEPS}")

OPEN_BOTH = """
import sys
from pathlib import Path
import optuna
from sweep.store import Tracker
from sweep.studies import make_storage
results = Path(sys.argv[1])
Tracker(f"sqlite:///{results / 'mlflow.db'}", "micro-tiny", results / "mlartifacts")
storage = make_storage(f"sqlite:///{results / 'optuna.db'}")
optuna.create_study(study_name="cells-tiny", storage=storage, load_if_exists=True)
"""


def cell_runs(results: Path) -> list:
    """Every cell run of ``micro-tiny``, deleted ones included, oldest first."""
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny")
    runs = client.search_runs([exp.experiment_id], "tags.kind = 'cell'", run_view_type=ViewType.ALL)
    return sorted(runs, key=lambda r: r.info.start_time)


def steps_of(results: Path, run_id: str) -> list[int]:
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    return sorted(m.step for m in client.get_metric_history(run_id, "train/loss"))


def test_processes_opening_one_new_store_at_once_all_get_it_whole(tmp_path: Path) -> None:
    """Three processes set up the same new MLflow and Optuna SQLite stores at once (two
    ``make sweep`` on a new results folder): without the lock the slower ones fail half-way
    through the schema ("table ... already exists")."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", OPEN_BOTH, str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(3)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], "\n".join(outputs)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert sorted(e.name for e in client.search_experiments()) == ["Default", "micro-tiny"]
    studies = optuna.get_all_study_summaries(storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    assert [s.study_name for s in studies] == ["cells-tiny"]


def test_two_sweeps_started_at_once_on_a_new_store_train_each_cell_once(tmp_path: Path) -> None:
    """Issue 15's first example: two ``make sweep`` at the same moment on a new results folder.
    Both end well, and each cell has one run: the second sweep finds each cell claimed (busy)
    or done (skipped), never a half-made store."""
    grid, results = tmp_path / "micro.yaml", tmp_path / "results"
    grid.write_text(MICRO)
    args = ["sweep", "--grid", str(grid), "--results", str(results)]
    procs = [start_slow_cli(args) for _ in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outputs)
    assert not any("Traceback" in out for out in outputs)
    runs = cell_runs(results)
    rows = sorted(r.data.tags["row"] for r in runs)
    assert rows == ["baseline", "moe", "sdpa_elementwise"], "\n".join(outputs)
    assert {(r.data.tags["status"], r.info.lifecycle_stage) for r in runs} == {("finished", "active")}
    summaries = [line for out in outputs for line in out.splitlines() if line.startswith("sweep finished")]
    finished = [int(line.split("finished ")[2].split(",")[0]) for line in summaries]
    assert sum(finished) == 3  # between them, each cell trained once


def test_the_set_up_lock_of_a_sqlite_store_sits_beside_its_file() -> None:
    assert sqlite_file("sqlite:////data/results/mlflow.db") == Path("/data/results/mlflow.db")
    assert sqlite_file("sqlite:///file:/data/a%3Fb/mlflow.db?uri=true") == Path("/data/a?b/mlflow.db")
    assert sqlite_file("postgresql+psycopg://u:pw@db/mlflow") is None  # its server orders set-up
    assert sqlite_file("http://server:5000") is None
    assert sqlite_file("sqlite://") is None  # in memory: one process


def test_a_cell_whose_first_checkpoint_write_failed_restarts_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The disk fills at the first checkpoint of two cells: the rerun starts both over in new
    runs and says "restarted 2", not "resumed 2"."""
    from experiments.checkpointing import AtomicCheckpointIO

    use_repo_cache(monkeypatch)
    grid, results = tmp_path / "micro.yaml", tmp_path / "results"
    grid.write_text(SHORT_MICRO)
    args = ["sweep", "--grid", str(grid), "--results", str(results), "--rows", "baseline,moe"]

    def disk_full(self, checkpoint, path, storage_options=None) -> None:
        Path(f"{path}.tmp").write_bytes(b"PK\x03\x04 half a checkpoint")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(AtomicCheckpointIO, "save_checkpoint", disk_full)
    assert main(args) == 1
    assert "finished 0, resumed 0, skipped 0, diverged 0, failed 2" in capsys.readouterr().out
    failed = cell_runs(results)
    assert [r.data.tags["status"] for r in failed] == ["failed", "failed"]

    monkeypatch.undo()  # space was freed
    use_repo_cache(monkeypatch)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("restarting from step 0 in run") == 2 and "resuming" not in out
    assert "finished 0, resumed 0, restarted 2, skipped 0, diverged 0, failed 0" in out
    runs = cell_runs(results)
    assert [r.info.lifecycle_stage for r in runs] == ["deleted", "deleted", "active", "active"]
    for old in failed:  # the half-written file went with the deleted run
        assert not (results / "checkpoints" / "micro-tiny" / old.info.run_id).exists()
    for new in runs[2:]:
        assert steps_of(results, new.info.run_id) == list(range(SHORT_STEPS))


def test_after_sigterm_the_cells_never_begun_are_not_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from experiments.lit import LMModule

    use_repo_cache(monkeypatch)
    grid, results = tmp_path / "micro.yaml", tmp_path / "results"
    grid.write_text(MICRO)
    original = LMModule.training_step

    def preempted_at_step_3(self: LMModule, batch, batch_idx: int):
        if self.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler pre-empts the job
        return original(self, batch, batch_idx)

    monkeypatch.setattr(LMModule, "training_step", preempted_at_step_3)
    assert main(["sweep", "--grid", str(grid), "--results", str(results)]) == 143
    out = capsys.readouterr().out
    assert "baseline s0 KILLED: SIGTERM at step 4" in out
    assert "finished 0, resumed 0, skipped 0, diverged 0, failed 0, killed 1, not started 2" in out
    (killed,) = cell_runs(results)  # the two others never got a run
    assert killed.data.tags["row"] == "baseline" and killed.data.tags["status"] == "killed"


def test_the_summary_counts_each_outcome_and_shows_the_rare_ones_only_when_they_happened() -> None:
    cells = load_grid(ROOT / "grids" / "table1.yaml").cells("tiny")
    statuses = ["finished", "resumed", "restarted", "restarted", "skipped", "busy", "failed", "not started"]
    outcomes = [CellResult(cell, s) for cell, s in zip(cells, statuses)]
    assert summary_line(outcomes) == (
        "finished 1, resumed 1, restarted 2, skipped 1, busy 1, diverged 0, failed 1, not started 1"
    )
    assert summary_line(outcomes[:2]) == "finished 1, resumed 1, skipped 0, diverged 0, failed 0"
    twin = CellResult(cells[0], "finished")  # a second row of the first cell's config: one cell
    assert summary_line([*outcomes[:2], twin]) == summary_line(outcomes[:2])
