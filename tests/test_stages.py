"""Later training stages (``Row.parent``): a row continues from another row's finished weights with
its own context, RoPE base, steps and schedule, in its own MLflow run linked to its parent's."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from experiments.checkpointing import FINAL_CHECKPOINT
from experiments.train import Training
from sweep.cli import main
from sweep.grid import load_grid, run_key
from sweep.gridfile import GridError
from tests.support import (
    LONG_MICRO,
    LONG_STEPS,
    STAGED,
    client_for,
    runs_of,
    start_slow_cli,
    swept,
    use_repo_cache,
    wait_for_checkpoint,
)

pytestmark = pytest.mark.slow  # make test-all: processes, signals, faults


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "micro.yaml"
    path.write_text(text)
    return path


def test_a_stage_builds_on_its_parents_overrides(tmp_path: Path) -> None:
    grid = load_grid(write(tmp_path, STAGED))
    cells = {c.row.id: c for c in grid.cells("tiny")}
    long, parent = cells["gated_long"], cells["sdpa_elementwise"]
    assert long.parent is parent
    assert long.config.model.gate == parent.config.model.gate  # the parent's gate, not the base's none
    assert (long.config.train.seq_len, long.config.train.batch_size) == (128, 1)  # x4 and x1/4 of 32, 4
    assert (long.config.model.max_seq_len, long.config.model.rope_theta) == (128, 1e6)
    assert long.config.train.max_steps == 12 and cells["baseline_long"].config.train.max_steps == LONG_STEPS
    assert long.run_key == run_key(long.config, parent) != run_key(long.config)


def test_a_stage_is_keyed_by_its_parent(tmp_path: Path) -> None:
    """The same stage config after another parent is another run."""
    first = load_grid(write(tmp_path, STAGED)).cells("tiny", rows=["gated_long"])
    other = STAGED.replace(
        "model: {gate: {position: sdpa}}", "model: {gate: {position: sdpa}}, train: {max_lr: 1e-3}"
    )
    second = load_grid(write(tmp_path, other)).cells("tiny", rows=["gated_long"])
    assert [c.row.id for c in first] == ["sdpa_elementwise", "gated_long"]  # the parent comes along
    assert first[1].config.train.max_lr != second[1].config.train.max_lr  # inherited from the parent
    same_lr = other.replace("max_steps: 12}", "max_steps: 12, max_lr: 2e-3}")
    third = load_grid(write(tmp_path, same_lr)).cells("tiny", rows=["gated_long"])
    assert third[1].config == first[1].config and third[1].run_key != first[1].run_key


@pytest.mark.parametrize(
    ("row", "message", "key"),
    [
        ("{id: later, parent: nowhere}", "'nowhere' is no earlier row of the grid", "parent"),
        ("{id: later, parent: later}", "'later' is this row", "parent"),
        ("{id: later, parent: baseline, model: {d_model: x2}}", "a stage may change only", "model.d_model"),
    ],
)
def test_a_bad_stage_is_one_line_naming_row_and_key(tmp_path: Path, row: str, message: str, key: str) -> None:
    with pytest.raises(GridError) as err:
        load_grid(write(tmp_path, LONG_MICRO + f"  - {row}\n"))
    text = str(err.value)
    assert message in text and "'later'" in text and key in text and "\n" not in text


def test_start_from_loads_every_parent_weight(micro: dict, tmp_path: Path, repo_cache: None) -> None:
    grid = load_grid(write(tmp_path, STAGED))
    cells = {c.row.id: c for c in grid.cells("tiny")}
    client = MlflowClient(f"sqlite:///{micro['results'] / 'mlflow.db'}")
    (parent_run,) = client.search_runs(
        [client.get_experiment_by_name("micro-tiny").experiment_id], "tags.row = 'baseline'"
    )
    weights = Path(parent_run.data.tags["checkpoint"])
    assert weights.name == FINAL_CHECKPOINT
    run = Training(cells["baseline_long"].config)
    run.start_from(weights)
    saved = torch.load(weights, weights_only=True)["state_dict"]
    mine = run.module.state_dict()
    assert set(saved) == set(mine)
    assert all(torch.equal(saved[k], mine[k]) for k in saved)


def history(results: Path, row: str, key: str) -> list[tuple[int, float]]:
    (run,) = runs_of(results, row)
    return sorted((m.step, m.value) for m in client_for(results).get_metric_history(run.info.run_id, key))


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Both stages of the baseline, uninterrupted, in one sweep."""
    for run in swept(tmp_path_factory.mktemp("staged"), STAGED, "--rows", "baseline_long"):
        assert run["code"] == 0
        yield run


def test_a_stage_runs_after_its_parent_linked_to_it(staged: dict, capsys: pytest.CaptureFixture) -> None:
    results = staged["results"]
    (parent,), (stage,) = runs_of(results, "baseline"), runs_of(results, "baseline_long")
    assert stage.data.tags["parent_run"] == parent.info.run_id
    assert stage.data.tags["mlflow.parentRunId"] == parent.info.run_id  # nested under it in the UI
    assert stage.data.tags["stage"] == "2" and "stage" not in parent.data.tags
    assert (
        stage.data.params["train.seq_len"] == "128" and stage.data.params["model.rope_theta"] == "1000000.0"
    )
    # the stage starts where the parent ended, not from a fresh init (ln 512 = 6.24 nats)
    first_loss = history(results, "baseline_long", "train/loss")[0][1]
    parent_first = history(results, "baseline", "train/loss")[0][1]
    assert first_loss < parent_first - 0.3
    staged["mp"].setenv("GATED_ATTN_CACHE", str(Path(__file__).resolve().parents[1] / ".cache"))
    args = ["sweep", "--grid", str(staged["grid"]), "--results", str(results), "--rows", "baseline_long"]
    capsys.readouterr()
    assert main(args) == 0  # a rerun trains nothing
    assert "finished 0, resumed 0, skipped 2" in capsys.readouterr().out


def test_a_stage_without_a_finished_parent_waits(tmp_path: Path, repo_cache: None, capsys) -> None:
    grid = write(
        tmp_path, STAGED.replace("max_lr: 2e-3, checkpoint_every: 5}", "max_lr: 1e9, checkpoint_every: 5}")
    )
    code = main(["sweep", "--grid", str(grid), "--results", str(tmp_path / "r"), "--rows", "baseline_long"])
    out = capsys.readouterr().out
    assert "baseline s0 DIVERGED" in out
    assert "baseline_long s0 FAILED: its parent row baseline s0 diverged" in out
    assert (
        code == 1 and runs_of(tmp_path / "r", "baseline_long") == []
    )  # no run for a stage that cannot start


def test_sigkill_mid_stage_resumes_from_its_own_checkpoint(
    staged: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    results = tmp_path / "results"
    use_repo_cache(monkeypatch)
    args = ["sweep", "--grid", str(staged["grid"]), "--results", str(results)]
    assert (
        main([*args, "--rows", "baseline"]) == 0
    )  # the parent first, so the only step files are the stage's
    proc = start_slow_cli([*args, "--rows", "baseline_long"])
    folder = wait_for_checkpoint(results, 15, [proc])
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stdout.close()
    (dead,) = runs_of(results, "baseline_long")
    assert dead.data.tags["status"] == "running" and folder.name == dead.info.run_id
    capsys.readouterr()
    assert main([*args, "--rows", "baseline_long"]) == 0
    assert f"resuming run {dead.info.run_id} (running) from step" in capsys.readouterr().out
    (run,) = runs_of(results, "baseline_long")
    assert run.info.run_id == dead.info.run_id and run.data.tags["status"] == "finished"
    for key in ("train/loss", "val/ppl/avg"):
        got, want = history(results, "baseline_long", key), history(staged["results"], "baseline_long", key)
        assert [s for s, _ in got] == [s for s, _ in want], key  # every step once
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5, abs=1e-6)
    assert [s for s, _ in history(results, "baseline_long", "train/loss")] == list(range(LONG_STEPS))


def test_queue_workers_train_each_stage_after_its_parent(tmp_path: Path, repo_cache: None) -> None:
    results = tmp_path / "results"
    grid = write(tmp_path, STAGED)
    rows = "baseline_long,gated_long"
    assert (
        main(["sweep", "--grid", str(grid), "--results", str(results), "--rows", rows, "--workers", "2"]) == 0
    )
    for parent_row, stage_row in (("baseline", "baseline_long"), ("sdpa_elementwise", "gated_long")):
        (parent,), (stage,) = runs_of(results, parent_row), runs_of(results, stage_row)
        assert stage.data.tags["parent_run"] == parent.info.run_id
        assert stage.info.start_time >= parent.info.end_time  # never popped while its parent trained


def test_a_stage_trains_again_once_its_parent_retrained_or_was_deleted(
    tmp_path: Path, repo_cache: None, capsys: pytest.CaptureFixture
) -> None:
    import pandas as pd

    grid, results = write(tmp_path, STAGED), tmp_path / "r"
    sweep = ["sweep", "--grid", str(grid), "--results", str(results), "--rows"]
    assert main([*sweep, "baseline_long"]) == 0
    (old_stage,) = runs_of(results, "baseline_long")

    def current(row: str) -> object:
        runs = [r for r in runs_of(results, row) if r.data.tags["status"] == "finished"]
        return max(runs, key=lambda r: r.info.start_time)

    assert main([*sweep, "baseline", "--force"]) == 0  # the parent retrained: the stage is stale
    table = pd.read_csv(results / "micro.csv").set_index("id")
    assert pd.isna(table.loc["baseline_long", "avg_ppl"])  # no longer shown as current
    capsys.readouterr()
    assert main([*sweep, "baseline_long"]) == 0
    assert "finished 1, resumed 0, skipped 1" in capsys.readouterr().out  # the stage, not the parent
    assert current("baseline_long").data.tags["parent_run"] == current("baseline").info.run_id
    assert current("baseline_long").info.run_id != old_stage.info.run_id

    client_for(results).delete_run(current("baseline").info.run_id)  # as in the MLflow UI
    capsys.readouterr()
    assert main([*sweep, "baseline_long"]) == 0
    assert "finished 2, resumed 0, skipped 0" in capsys.readouterr().out  # both train again
    assert current("baseline_long").data.tags["parent_run"] == current("baseline").info.run_id
