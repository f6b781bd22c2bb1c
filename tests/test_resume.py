"""Crash and Ctrl-C: a killed cell resumes in its own MLflow run and trains as if never stopped."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import ViewType

from sweep.cli import main
from tests.support import LONG_MICRO, LONG_STEPS, start_slow_cli, swept, use_repo_cache, wait_for_checkpoint

pytestmark = pytest.mark.slow  # make test-all: processes, signals, faults

STEPS = LONG_STEPS
ROW = "sdpa_elementwise"


def sweep_args(grid: Path, results: Path) -> list[str]:
    return ["sweep", "--grid", str(grid), "--results", str(results), "--rows", ROW]


def client_for(results: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")


def cell_runs(results: Path) -> list:
    client = client_for(results)
    exp = client.get_experiment_by_name("micro-tiny")
    query = f"tags.kind = 'cell' and tags.row = '{ROW}'"
    return client.search_runs([exp.experiment_id], query, run_view_type=ViewType.ALL)


def history(results: Path, key: str) -> list[tuple[int, float]]:
    (run,) = cell_runs(results)
    return sorted((m.step, m.value) for m in client_for(results).get_metric_history(run.info.run_id, key))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    for run in swept(tmp_path_factory.mktemp("uninterrupted"), LONG_MICRO, "--rows", ROW):
        assert run["code"] == 0
        yield run


def assert_same_training(results: Path, reference: Path) -> None:
    for key in ("train/loss", "val/ppl/avg"):
        got, want = history(results, key), history(reference, key)
        assert [s for s, _ in got] == [s for s, _ in want], f"{key}\n{got}\n{want}"  # every step once
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-5, abs=1e-6)
    assert [s for s, _ in history(results, "train/loss")] == list(range(STEPS))


def test_sigkill_mid_cell_resumes_in_the_same_run(
    uninterrupted: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    results = tmp_path / "results"
    proc = start_slow_cli(sweep_args(uninterrupted["grid"], results))
    folder = wait_for_checkpoint(results, 15, [proc])
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stdout.close()
    (dead,) = cell_runs(results)
    assert dead.info.status == "RUNNING" and dead.data.tags["status"] == "running"  # nobody told MLflow
    killed_at = max(s for s, _ in history(results, "train/loss"))
    assert killed_at < STEPS - 1

    use_repo_cache(monkeypatch)
    assert main(sweep_args(uninterrupted["grid"], results)) == 0
    out = capsys.readouterr().out
    assert f"resuming run {dead.info.run_id} (running) from step" in out, out
    assert "finished 0, resumed 1, skipped 0" in out

    (run,) = cell_runs(results)  # no second run for the cell, not even a deleted one
    assert run.info.run_id == dead.info.run_id and run.info.status == "FINISHED"
    assert run.data.tags["status"] == "finished" and run.data.tags["resumed"] == "1"
    assert_same_training(results, uninterrupted["results"])
    assert sorted(p.name for p in folder.iterdir()) == ["final.ckpt", "final.ckpt.sha256"]


def test_ctrl_c_saves_marks_killed_and_the_next_sweep_resumes(
    uninterrupted: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    results = tmp_path / "results"
    proc = start_slow_cli(sweep_args(uninterrupted["grid"], results))
    folder = wait_for_checkpoint(results, 5, [proc])
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert f"{ROW} s0 KILLED: SIGINT at step" in out
    assert "sweep interrupted after" in out and "killed 1" in out

    (killed,) = cell_runs(results)
    assert killed.info.status == "KILLED" and killed.data.tags["status"] == "killed"
    saved = Path(killed.data.tags["checkpoint"])
    stopped_at = int(saved.stem.removeprefix("step"))
    assert saved.parent == folder and saved.is_file() and 5 < stopped_at < STEPS
    assert max(s for s, _ in history(results, "train/loss")) == stopped_at - 1  # saved after that step

    use_repo_cache(monkeypatch)
    assert main(sweep_args(uninterrupted["grid"], results)) == 0
    assert f"(killed) from {saved.name}" in capsys.readouterr().out
    (run,) = cell_runs(results)
    assert run.info.run_id == killed.info.run_id and run.data.tags["status"] == "finished"
    assert_same_training(results, uninterrupted["results"])


def test_a_crashed_cell_keeps_its_checkpoint_fails_the_sweep_and_resumes(
    uninterrupted: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from experiments.lit import LMModule

    use_repo_cache(monkeypatch)
    results = tmp_path / "results"
    args = ["sweep", "--grid", str(uninterrupted["grid"]), "--results", str(results)]
    original = LMModule.training_step

    def crash_at_step_23(self: LMModule, batch, batch_idx: int):
        if self.cfg.model.gate is not None and self.global_step == 23:
            raise RuntimeError("disk full")
        return original(self, batch, batch_idx)

    monkeypatch.setattr(LMModule, "training_step", crash_at_step_23)
    assert main(args) == 1  # a failed cell fails the sweep, after the other cells ran
    out = capsys.readouterr().out
    assert f"{ROW} s0 FAILED: RuntimeError: disk full" in out
    assert "finished 2, resumed 0, skipped 0, diverged 0, failed 1" in out
    (failed,) = cell_runs(results)
    assert failed.data.tags["status"] == "failed" and failed.info.status == "FAILED"
    kept = Path(failed.data.tags["checkpoint"])
    assert kept.name == "step000020.ckpt" and kept.is_file()  # the last good one

    monkeypatch.setattr(LMModule, "training_step", original)  # the cause is fixed
    assert main(args) == 0
    out = capsys.readouterr().out
    assert f"resuming run {failed.info.run_id} (failed) from step000020.ckpt" in out
    assert "finished 0, resumed 1, skipped 2, diverged 0, failed 0" in out
    assert_same_training(results, uninterrupted["results"])


def test_a_resume_with_another_placement_is_refused_in_one_line(
    uninterrupted: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    results = tmp_path / "results"
    proc = start_slow_cli(sweep_args(uninterrupted["grid"], results))
    wait_for_checkpoint(results, 5, [proc])
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    (killed,) = cell_runs(results)
    moved = tmp_path / "micro.yaml"  # the same cells (placement is not in the run key), split in two
    moved.write_text(LONG_MICRO.replace("checkpoint_every: 5}", "checkpoint_every: 5, grad_accum: 2}"))
    use_repo_cache(monkeypatch)
    capsys.readouterr()
    assert main(sweep_args(moved, results)) == 1
    out = capsys.readouterr().out
    run_id = killed.info.run_id
    assert (
        f"{ROW} s0 FAILED: its unfinished run {run_id} trained with another placement "
        "(train.grad_accum 1 -> 2), and resuming it so would change its numbers" in out
    )
    (run,) = cell_runs(results)  # untouched: still the killed run, nothing logged after its stop
    assert run.data.tags["status"] == "killed" and run.data.metrics == killed.data.metrics
