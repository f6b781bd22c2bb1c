"""Comparing runs as a researcher does: ``make compare RUNS=a,b`` prints only the configuration
keys that differ and the metrics side by side with their difference, and draws one figure (bad
names: one line, status 2); ``make ui`` prints the URL of the grid's runs and tags the
experiment so the UI opens on them; a table never mixes runs of different arithmetic."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient

from experiments import names as N
from sweep.browse import main
from sweep.grid import load_grid
from tests.support import ROOT


def _compare(micro: dict, runs: str, capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    code = main(["compare", "--grid", str(micro["grid"]), "--results", str(micro["results"]), "--runs", runs])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _table(out: str, heading: str) -> list[list[str]]:
    """The body cells of the Markdown table that follows the line starting with ``heading``."""
    block = out.split(heading, 1)[1].split("\n\n")[1]
    return [[c.strip() for c in row.strip().strip("|").split("|")] for row in block.splitlines()[2:]]


def test_two_rows_show_just_the_gate_keys_and_the_metric_differences(
    micro: dict, capsys: pytest.CaptureFixture
) -> None:
    code, out, _ = _compare(micro, "baseline,sdpa_elementwise", capsys)
    assert code == 0
    keys = {row[0]: row[1:] for row in _table(out, "Configuration keys that differ")}
    assert all(k.startswith("model.gate") for k in keys)  # nothing else differs
    assert keys["model.gate.position"] == ["—", "sdpa"] and keys["model.gate"] == ["none", "—"]
    metrics = {row[0]: row[1:] for row in _table(out, "Metrics (mean")}
    table = pd.read_csv(micro["results"] / "micro.csv").set_index("id")
    a, b = table.loc["baseline", "avg_ppl"], table.loc["sdpa_elementwise", "avg_ppl"]
    assert metrics["val/ppl/avg"][0] == f"{a:.3f}" and metrics["val/ppl/avg"][1] == f"{b:.3f}"
    assert float(metrics["val/ppl/avg"][2]) == pytest.approx(b - a, abs=1e-3)
    assert metrics["val/ppl/avg"][3] == "1 paired"
    assert "gate/score_mean" not in metrics  # the baseline has no gate: not a metric of both
    assert not any(".layer_" in k or k.startswith("train/") for k in metrics)
    figure = micro["results"] / "figures" / "compare_baseline_sdpa_elementwise.png"
    assert figure.stat().st_size > 10_000 and f"figure: {figure}" in out


def test_two_run_ids_compare_the_same_way(micro: dict, capsys: pytest.CaptureFixture) -> None:
    client = MlflowClient(tracking_uri=f"sqlite:///{micro['results'] / 'mlflow.db'}")
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        "tags.kind = 'cell' and tags.status = 'finished'",
    )
    by_row = {r.data.tags["row"]: r.info.run_id for r in runs}
    code, out, _ = _compare(micro, f"{by_row['baseline']},{by_row['moe']}", capsys)
    assert code == 0
    keys = {row[0] for row in _table(out, "Configuration keys that differ")}
    assert "model.moe.n_experts" in keys and all(
        k.startswith("model.moe") for k in keys - {"model.ffn_dim_effective"}
    )
    assert f"figure: {Path(micro['results']) / 'figures'}/compare_{by_row['baseline']}" in out


@pytest.mark.parametrize("runs", ["baseline", "baseline,baseline", "baseline,nonesuch", "a,b,c"])
def test_a_name_that_is_not_a_row_or_a_run_is_one_line(
    runs: str, micro: dict, capsys: pytest.CaptureFixture
) -> None:
    code, _, err = _compare(micro, runs, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: RUNS: ")


# --- the MLflow UI on the right page -------------------------------------------------------------


def test_make_ui_prints_the_url_of_the_grids_runs_and_tags_the_experiment_for_it(
    micro: dict, capsys: pytest.CaptureFixture
) -> None:
    args = ["ui", "--grid", str(micro["grid"]), "--results", str(micro["results"]), "--print-only"]
    assert main([*args, "--port", "5123"]) == 0
    out = capsys.readouterr().out
    client = MlflowClient(tracking_uri=f"sqlite:///{micro['results'] / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny")
    url = f"http://127.0.0.1:5123/#/experiments/{exp.experiment_id}/runs?viewStateShareKey=table"
    assert out.startswith(f"experiment micro-tiny: 3 cell run(s); open {url}&workflowType=machine_learning\n")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    view = json.loads(exp.tags["mlflow.sharedViewState.table"])
    assert view["searchFilter"] == "tags.kind = 'cell'" and view["orderByKey"] == "metrics.`val/ppl/avg`"
    assert "metrics.`val/ppl/avg`" in view["selectedColumns"] and "tags.`seed`" in view["selectedColumns"]
    names = {r.info.run_name for r in client.search_runs([exp.experiment_id], view["searchFilter"])}
    assert names == {"baseline-s0", "sdpa_elementwise-s0", "moe-s0"}  # what the saved view lists


# --- one arithmetic per table ----------------------------------------------------------------------


def test_a_table_never_mixes_runs_computed_with_different_thread_counts() -> None:
    from sweep.report.runs import arithmetic, one_arithmetic
    from sweep.report.write import _left_out_note

    assert arithmetic({"device": "cpu", "threads": "1"}) == "cpu, 1 thread"
    assert arithmetic({"device": "cpu", "threads": "2"}) == "cpu, 2 threads"
    assert arithmetic({}) == "unrecorded"
    runs = pd.DataFrame(
        {
            "row": ["baseline", "gate", "baseline", "gate"],
            "seed": [0, 0, 1, 1],
            "arithmetic": ["cpu, 1 thread", "cpu, 1 thread", "cpu, 2 threads", "cpu, 1 thread"],
        }
    )
    kept, left_out = one_arithmetic(runs)
    assert list(kept.index) == [0, 1, 3] and list(left_out.index) == [2]
    grid = load_grid(ROOT / "grids" / "table1.yaml")
    note = _left_out_note(grid, "tiny", kept, left_out)
    assert "baseline s1 (cpu, 2 threads)" in note and "(cpu, 1 thread)" in note
    assert f"`make sweep GRID={grid.file} SCALE=tiny ROWS=baseline SEEDS=2 FORCE=1`" in note
    same, none = one_arithmetic(runs.iloc[[0, 1, 3]])
    assert len(same) == 3 and none.empty and _left_out_note(grid, "tiny", same, none) == ""


def test_a_table_never_mixes_runs_of_different_cpu_instruction_sets() -> None:
    """Two Intel CPUs that each pick their fastest kernels sum in different orders (issue 26: 1 % of
    Avg PPL after 400 steps); the recorded arithmetic tells them apart."""
    from sweep.report.runs import arithmetic, one_arithmetic

    pinned = {"device": "cpu", "threads": "1", "cpu_arith": "avx2, mkl AVX2, GenuineIntel", "torch": "2.13.0"}
    native = {**pinned, "cpu_arith": "avx512, mkl auto, GenuineIntel"}
    assert arithmetic(pinned) == "cpu (avx2, mkl AVX2, GenuineIntel), 1 thread, torch 2.13.0"
    assert arithmetic({**pinned, "device": "NVIDIA H200"}) == "NVIDIA H200, 1 thread, torch 2.13.0"
    assert arithmetic({**pinned, "torch": "2.14.1"}) != arithmetic(pinned)  # another build's kernels
    runs = pd.DataFrame(
        {
            "row": ["baseline", "gate", "gate"],
            "seed": [0, 0, 1],
            "arithmetic": map(arithmetic, [pinned, pinned, native]),
        }
    )
    kept, left_out = one_arithmetic(runs)
    assert list(kept.index) == [0, 1] and list(left_out["arithmetic"]) == [arithmetic(native)]


def test_a_side_that_diverged_says_so_with_seed_and_step() -> None:
    from sweep.report.compare import Side, diverged_note

    runs = pd.DataFrame(
        {"seed": [0, 1], "status": ["finished", "diverged"], N.DIVERGED_STEP: [math.nan, 13.0]}
    )
    note = diverged_note(Side("big_lr", {}, runs))
    assert (
        note == "big_lr diverged (s1 at step 13; 1 of 2 run(s)): its metrics are those of the diverged model"
    )
    assert diverged_note(Side("ok", {}, runs[runs["status"] == "finished"])) == ""
