"""The store changed from outside: an experiment or a run deleted in the MLflow UI, a checkpoint
folder deleted or damaged by hand, the SQLite file deleted mid-sweep. Each is a state with one
line saying what was done, never a traceback."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient
from mlflow.entities import ViewType

from sweep.cli import main
from tests.support import LONG_MICRO, LONG_STEPS, use_repo_cache

pytestmark = pytest.mark.slow  # make test-all: processes, signals, faults

SHORT_STEPS = 12  # checkpoints at steps 5 and 10
SHORT_MICRO = LONG_MICRO.replace(f"max_steps: {LONG_STEPS}", f"max_steps: {SHORT_STEPS}")


def client_for(results: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")


def cell_runs(results: Path) -> list:
    """Every cell run of ``micro-tiny``, deleted ones included, oldest first."""
    client = client_for(results)
    exp = client.get_experiment_by_name("micro-tiny")
    runs = client.search_runs([exp.experiment_id], "tags.kind = 'cell'", run_view_type=ViewType.ALL)
    return sorted(runs, key=lambda r: r.info.start_time)


def copied(micro: dict, tmp_path: Path) -> tuple[list[str], Path]:
    """A copy of the micro sweep's results folder, and the sweep arguments that read it."""
    results = tmp_path / "results"
    shutil.copytree(micro["results"], results)
    return ["--grid", str(micro["grid"]), "--results", str(results)], results


def delete_experiment(results: Path) -> str:
    """What the UI's delete button does; returns the experiment's id."""
    client = client_for(results)
    exp_id = client.get_experiment_by_name("micro-tiny").experiment_id
    client.delete_experiment(exp_id)
    return exp_id


def test_a_sweep_restores_an_experiment_deleted_in_the_ui_and_trains_nothing_again(
    micro: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    use_repo_cache(monkeypatch)
    args, results = copied(micro, tmp_path)
    exp_id = delete_experiment(results)
    assert main(["sweep", *args]) == 0
    out = capsys.readouterr().out
    assert "experiment micro-tiny was deleted in the MLflow UI; restored it with its 3 cell runs" in out
    assert "3 cells, 0 to train, 3 finished earlier" in out
    assert "finished 0, resumed 0, skipped 3, diverged 0, failed 0" in out
    assert client_for(results).get_experiment(exp_id).lifecycle_stage == "active"
    assert [r.info.lifecycle_stage for r in cell_runs(results)] == ["active"] * 3


@pytest.mark.parametrize("command", ["tables", "eval"])
def test_tables_and_eval_restore_an_experiment_deleted_in_the_ui(
    command: str, micro: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    use_repo_cache(monkeypatch)
    args, results = copied(micro, tmp_path)
    delete_experiment(results)
    assert main([command, *args]) == 0
    out = capsys.readouterr().out
    assert out.count("experiment micro-tiny was deleted in the MLflow UI; restored it") == 1
    table = pd.read_csv(results / "micro.csv")
    assert list(table["status"]) == ["ok"] * 3


def test_an_experiment_that_cannot_be_restored_stops_with_one_line_and_status_2(
    micro: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from mlflow.exceptions import MlflowException

    use_repo_cache(monkeypatch)
    args, results = copied(micro, tmp_path)
    exp_id = delete_experiment(results)

    def refused(self, experiment_id: str) -> None:
        raise MlflowException("permission denied")

    monkeypatch.setattr(MlflowClient, "restore_experiment", refused)
    assert main(["sweep", *args]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith(f"error: experiment micro-tiny (id {exp_id}) was deleted in the MLflow UI")
    uri = f"sqlite:///{(results / 'mlflow.db').resolve()}"
    assert f"mlflow gc --backend-store-uri '{uri}' --tracking-uri '{uri}'" in line
    assert "to train" not in captured.out  # stopped before planning


def test_a_finished_run_deleted_in_the_ui_is_trained_again(
    micro: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    use_repo_cache(monkeypatch)
    args, results = copied(micro, tmp_path)
    (discarded,) = [r for r in cell_runs(results) if r.data.tags["row"] == "moe"]
    client_for(results).delete_run(discarded.info.run_id)
    assert main(["sweep", *args]) == 0
    out = capsys.readouterr().out
    assert "3 cells, 1 to train, 2 finished earlier" in out
    assert "finished 1, resumed 0, skipped 2, diverged 0, failed 0" in out
    moe = [r for r in cell_runs(results) if r.data.tags["row"] == "moe"]
    assert [(r.info.run_id == discarded.info.run_id, r.info.lifecycle_stage) for r in moe] == [
        (True, "deleted"),  # still the user's to restore, never reused
        (False, "active"),
    ]
    assert moe[1].data.tags["status"] == "finished"


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The baseline cell of SHORT_MICRO crashed at step 7: run ``failed``, ``step000005.ckpt`` kept."""
    from experiments.lit import LMModule

    tmp = tmp_path_factory.mktemp("crashed")
    grid, results = tmp / "micro.yaml", tmp / "results"
    grid.write_text(SHORT_MICRO)
    mp = pytest.MonkeyPatch()
    use_repo_cache(mp)
    original = LMModule.training_step

    def crash_at_step_7(self: LMModule, batch, batch_idx: int):
        if self.global_step == 7:
            raise RuntimeError("CUDA error: an illegal memory access")
        return original(self, batch, batch_idx)

    mp.setattr(LMModule, "training_step", crash_at_step_7)
    assert main(["sweep", "--grid", str(grid), "--results", str(results), "--rows", "baseline"]) == 1
    mp.undo()
    (run,) = cell_runs(results)
    assert run.data.tags["status"] == "failed" and Path(run.data.tags["checkpoint"]).name == "step000005.ckpt"
    yield {"grid": grid, "results": results, "run_id": run.info.run_id}


def crashed_copy(crashed: dict, tmp_path: Path) -> tuple[list[str], Path, Path]:
    """A copy of the crashed state: sweep arguments, results folder, the failed run's checkpoints."""
    results = tmp_path / "results"
    shutil.copytree(crashed["results"], results)
    args = ["sweep", "--grid", str(crashed["grid"]), "--results", str(results), "--rows", "baseline"]
    return args, results, results / "checkpoints" / "micro-tiny" / crashed["run_id"]


def test_a_failed_run_whose_checkpoint_folder_was_deleted_by_hand_starts_over_and_says_so(
    crashed: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    use_repo_cache(monkeypatch)
    args, results, folder = crashed_copy(crashed, tmp_path)
    shutil.rmtree(folder)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"run {crashed['run_id']} (failed) has no folder {folder}; deleted it" in out
    assert "finished 0, resumed 0, restarted 1, skipped 0, diverged 0, failed 0" in out
    old, new = cell_runs(results)
    assert old.info.lifecycle_stage == "deleted" and new.data.tags["status"] == "finished"
    steps = sorted(m.step for m in client_for(results).get_metric_history(new.info.run_id, "train/loss"))
    assert steps == list(range(SHORT_STEPS))


def _overwrite_the_middle(path: Path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(64)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, problem",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:4096]), "4,096 bytes, "),  # a copy cut short
        (_overwrite_the_middle, "changed since it was written (another sha256)"),  # same size
        (  # written before checkpoints had their record: still checked as an archive
            lambda p: (p.with_name(p.name + ".sha256").unlink(), p.write_bytes(p.read_bytes()[:4096])),
            "not a whole torch archive",
        ),
    ],
    ids=["cut short", "overwritten", "cut short, no record"],
)
def test_a_damaged_checkpoint_is_not_resumed_from(
    crashed: dict,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
    damage: Callable[[Path], object],
    problem: str,
) -> None:
    use_repo_cache(monkeypatch)
    args, results, folder = crashed_copy(crashed, tmp_path)
    checkpoint = folder / "step000005.ckpt"
    damage(checkpoint)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"has an unusable checkpoint {checkpoint} ({problem}" in out
    assert "finished 0, resumed 0, restarted 1, skipped 0, diverged 0, failed 0" in out
    assert not folder.exists()


def test_an_unfinished_run_deleted_in_the_ui_is_not_resumed(
    crashed: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    use_repo_cache(monkeypatch)
    args, results, folder = crashed_copy(crashed, tmp_path)
    client_for(results).delete_run(crashed["run_id"])
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "resuming" not in out and "restarting" not in out  # the deleted run is not looked at
    assert "finished 1, resumed 0, skipped 0, diverged 0, failed 0" in out
    old, new = cell_runs(results)
    assert (old.info.run_id, old.info.lifecycle_stage) == (crashed["run_id"], "deleted")
    assert new.data.tags["status"] == "finished"
    assert (folder / "step000005.ckpt").is_file()  # the discarded run's files are the user's


def test_a_run_deleted_while_it_trains_fails_its_cell_with_one_line_and_the_sweep_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from experiments.lit import LMModule

    use_repo_cache(monkeypatch)
    grid, results = tmp_path / "micro.yaml", tmp_path / "results"
    grid.write_text(SHORT_MICRO)
    original = LMModule.training_step

    def deleted_in_the_ui_at_step_3(self: LMModule, batch, batch_idx: int):
        if self.global_step == 3 and self.cfg.model.moe is None:
            (run,) = [r for r in cell_runs(results) if r.data.tags["row"] == "baseline"]
            client_for(results).delete_run(run.info.run_id)
        return original(self, batch, batch_idx)

    monkeypatch.setattr(LMModule, "training_step", deleted_in_the_ui_at_step_3)
    args = ["sweep", "--grid", str(grid), "--results", str(results), "--rows", "baseline,moe"]
    assert main(args) == 1
    out = capsys.readouterr().out
    (deleted,) = [r for r in cell_runs(results) if r.data.tags["row"] == "baseline"]
    assert f"FAILED: its run {deleted.info.run_id} was deleted in the MLflow UI while it trained" in out
    assert "finished 1, resumed 0, skipped 0, diverged 0, failed 1" in out
    assert [r.data.tags["status"] for r in cell_runs(results) if r.data.tags["row"] == "moe"] == ["finished"]


def test_a_sqlite_store_deleted_mid_sweep_stops_it_with_one_line_and_status_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import sweep.run.worker as worker

    use_repo_cache(monkeypatch)
    grid, results = tmp_path / "micro.yaml", tmp_path / "results"
    grid.write_text(SHORT_MICRO)
    run_cell = worker.run_cell

    def store_deleted_before_training(cell, ctx, *args, **kwargs):
        (results / "mlflow.db").unlink(missing_ok=True)  # `rm results/mlflow.db` between plan and train
        return run_cell(cell, ctx, *args, **kwargs)

    monkeypatch.setattr(worker, "run_cell", store_deleted_before_training)
    assert main(["sweep", "--grid", str(grid), "--results", str(results), "--rows", "baseline"]) == 2
    captured = capsys.readouterr()
    assert "1 to train" in captured.out
    db = (results / "mlflow.db").resolve()
    assert captured.err.splitlines() == [
        f"error: tracking store sqlite:///{db} is gone: {db} was deleted or replaced while this process "
        "used it; run the same command again to train into a new store"
    ]
