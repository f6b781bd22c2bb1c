"""MLflow's system metrics in every cell's run, and the opt-out."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow import MlflowClient

from sweep.cli import main
from sweep.run.sysmetrics import ENV
from tests.support import MICRO


def cell_runs(results: Path) -> list:
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny")
    return client.search_runs([exp.experiment_id], "tags.kind = 'cell'")


def test_every_cell_run_has_cpu_and_memory_metrics(micro: dict) -> None:
    runs = [r for r in cell_runs(micro["results"]) if r.data.tags["status"] == "finished"]
    assert len(runs) >= 3  # other tests may add runs to the shared micro store
    for run in runs:  # a cell of a few seconds still gets its sample at the end
        metrics = run.data.metrics
        assert metrics["system/cpu_utilization_percentage"] >= 0
        assert metrics["system/system_memory_usage_megabytes"] > 0


def test_system_metrics_can_be_turned_off(
    repo_cache: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    grid = tmp_path / "micro.yaml"
    grid.write_text(MICRO)
    results = tmp_path / "results"
    monkeypatch.setenv(ENV, "1")  # the flag wins over the environment
    args = ["sweep", "--grid", str(grid), "--results", str(results), "--rows", "baseline"]
    assert main([*args, "--no-system-metrics"]) == 0
    (run,) = cell_runs(results)
    assert run.data.metrics["val/ppl/avg"] > 0
    assert not [k for k in run.data.metrics if k.startswith("system/")]
