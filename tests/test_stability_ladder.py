"""The stability ladder (Table 2's claim at small scale): Wortsman et al.'s LR sensitivity and the
largest LR that trains, computed by hand on made-up ladders; the shipped grid; a ladder never
prunes; the report from a study; ``sweep.cli stability`` end to end on a micro model."""

from __future__ import annotations

import math
from pathlib import Path

import optuna
import pandas as pd
import pytest
from mlflow import MlflowClient
from optuna.trial import TrialState

from experiments.lit import LMModule
from sweep.cli import main
from sweep.grid import load_grid
from sweep.report.stability import (
    largest_lr_that_trains,
    lr_sensitivity,
    rung_losses,
    trains,
    write_ladder_report,
)
from sweep.run.tune import make_pruner, tune_row
from sweep.studies import DIVERGED_ATTR, VAL_LOSS_ATTR
from tests.support import ROOT, use_repo_cache

L0 = math.log(2048)  # 7.6246 nats
LADDER = [1e-3, 1e-2, 1e-1, 1.0]

MICRO = """\
name: micro
title: "Micro ladder"
lr_ladder: [4e-3, 8e-3]
base:
  model: {vocab_size: 512, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, head_dim: 8,
          ffn_dim: 64, max_seq_len: 32}
  train: {max_steps: 8, batch_size: 4, seq_len: 32, warmup_steps: 2, val_every: 4, val_tokens: 512,
          max_lr: 2e-3, min_lr: 1e-5, checkpoint_every: 0}
  data: {vocab_size: 512, max_chars_per_source: 200000}
scales: {tiny: {}}
rows:
  - {id: baseline, label: "Baseline"}
  - {id: gated, label: "G1", compare_to: baseline, model: {gate: {position: sdpa}}}
"""


def test_lr_sensitivity_and_the_largest_lr_that_trains_by_hand() -> None:
    # Best at 1e-2, near L0 yet below it (so training) at 0.1, diverged at 1.0 (counted as L0).
    losses = [5.0, 4.0, 7.0, math.inf]
    assert lr_sensitivity(losses, L0) == pytest.approx((1.0 + 0.0 + 3.0 + (L0 - 4.0)) / 4)  # 1.90615
    assert trains(losses, L0) == [True, True, True, False]  # 7.0 is still below L0
    assert largest_lr_that_trains(LADDER, losses, L0) == 1e-1
    # A rung that finished above L0 counts L0 too, and does not train.
    losses = [6.0, 6.9, 8.0, math.inf]
    assert lr_sensitivity(losses, L0) == pytest.approx((0.0 + 0.9 + 2 * (L0 - 6.0)) / 4)  # 1.03731
    assert trains(losses, L0) == [True, True, False, False]
    assert largest_lr_that_trains(LADDER, losses, L0) == 1e-2
    # Every rung diverged: all at L0, no spread, nothing trains.
    assert lr_sensitivity([math.inf] * 4, L0) == 0.0
    assert math.isnan(largest_lr_that_trains(LADDER, [math.inf] * 4, L0))
    # A rung without a result (failed, or not run yet) leaves the sensitivity undefined.
    assert math.isnan(lr_sensitivity([5.0, math.nan, 7.0, math.inf], L0))
    assert largest_lr_that_trains(LADDER, [5.0, math.nan, 5.5, math.inf], L0) == 1e-1


def test_the_stability_grid_has_four_dense_rows_with_and_without_qk_norm() -> None:
    grid = load_grid(ROOT / "grids/stability.yaml")
    cells = {c.row.id: c.config for c in grid.cells("tiny")}
    assert list(cells) == ["baseline", "sdpa_elementwise", "baseline_no_qknorm", "sdpa_elementwise_no_qknorm"]
    assert [c.model.qk_norm for c in cells.values()] == [True, True, False, False]
    assert [c.model.gate.position if c.model.gate else None for c in cells.values()] == [None, "sdpa"] * 2
    assert all(c.model.gate.activation == "sigmoid" for c in cells.values() if c.model.gate)
    assert all(
        c.model.moe is None and c.model.n_layers == 7 and c.model.d_model == 128 for c in cells.values()
    )
    assert {(c.train.batch_size, c.train.seq_len, c.train.max_steps) for c in cells.values()} == {
        (8, 128, 160)
    }
    assert [grid.reference(r).id for r in grid.rows] == ["baseline", "baseline"] + ["baseline_no_qknorm"] * 2
    assert grid.lr_ladder == (2e-3, 1e-2, 0.1, 0.5, 1.0)
    for scale in grid.scales:  # the cosine's floor is below every rung at every scale
        assert max(c.config.train.min_lr for c in grid.cells(scale)) <= grid.lr_ladder[0]


def _study_with_values(pruner: optuna.pruners.BasePruner) -> optuna.Study:
    """Three finished trials that reported 1.0 at step 50; the pruner then judges a fourth."""
    study = optuna.create_study(direction="minimize", pruner=pruner)
    for _ in range(3):
        trial = study.ask()
        trial.report(1.0, 50)
        study.tell(trial, 1.0)
    return study


def test_a_ladder_never_prunes_where_the_search_would() -> None:
    search, ladder = _study_with_values(make_pruner(None, 120)), _study_with_values(make_pruner(LADDER, 120))
    for study, prunes in ((search, True), (ladder, False)):
        trial = study.ask()
        trial.report(100.0, 50)  # far worse than the median, after the first third of training
        assert bool(trial.should_prune()) is prunes


def _ladder_study(rungs: dict[float, float | str]) -> optuna.Study:
    """A finished ladder study: a loss (nats) per rung, or ``diverged`` / ``fail``."""
    study = optuna.create_study(direction="minimize")
    dist = {"max_lr": optuna.distributions.CategoricalDistribution([1e-3, 8e-3])}
    for lr, result in rungs.items():
        if result == "diverged":
            trial = optuna.trial.create_trial(
                params={"max_lr": lr}, distributions=dist, state=TrialState.PRUNED,
                user_attrs={DIVERGED_ATTR: "training loss nan at step 3 is not finite"},
            )  # fmt: skip
        elif result == "fail":
            trial = optuna.trial.create_trial(
                params={"max_lr": lr}, distributions=dist, state=TrialState.FAIL
            )
        else:
            trial = optuna.trial.create_trial(
                params={"max_lr": lr}, distributions=dist, value=math.exp(result),
                user_attrs={VAL_LOSS_ATTR: result},
            )  # fmt: skip
        study.add_trial(trial)
    return study


def test_the_report_reads_losses_from_the_studies_and_says_whether_the_gate_widens(tmp_path: Path) -> None:
    (tmp_path / "micro.yaml").write_text(MICRO)
    grid = load_grid(tmp_path / "micro.yaml")
    studies = {
        "baseline": _ladder_study({1e-3: 5.5, 8e-3: "diverged"}),
        "gated": _ladder_study({1e-3: 5.6, 8e-3: 5.2}),
    }
    failed_first = rung_losses(_ladder_study({1e-3: "fail", 8e-3: 5.0}), [1e-3, 8e-3])
    assert math.isnan(failed_first[0]) and failed_first[1] == 5.0  # a failed rung has no result
    paths, body = write_ladder_report(grid, "tiny", studies, [1e-3, 8e-3], tmp_path, "python -m sweep.cli x")
    l0 = math.log(512)  # 6.238 nats
    table = pd.read_csv(paths[1]).set_index("row")
    assert table.loc["baseline", "loss@1e-03"] == 5.5 and table.loc["baseline", "loss@8e-03"] == math.inf
    assert table.loc["baseline", "largest_lr_that_trains"] == 1e-3
    assert table.loc["baseline", "lr_sensitivity"] == pytest.approx((0 + l0 - 5.5) / 2)  # 0.369
    assert table.loc["gated", "largest_lr_that_trains"] == 8e-3
    assert table.loc["gated", "lr_sensitivity"] == pytest.approx((5.6 - 5.2 + 0) / 2)  # 0.2
    assert table.loc["gated", "l0"] == pytest.approx(l0)
    line = next(line for line in body.splitlines() if line.startswith("| baseline "))
    assert [c.strip() for c in line.strip("|").split("|")] == [
        "baseline", "yes", "none", "5.500", "diverged", "0.001", "0.369"
    ]  # fmt: skip
    assert "G1 vs Baseline: largest LR that trains 0.008 vs 0.001: widens the stable range (x8)" in body
    assert paths[0].read_text().endswith(body)
    assert paths[2] == tmp_path / "figures" / "micro_lr_ladder.png" and paths[2].stat().st_size > 10_000


def test_a_study_trained_on_another_config_of_the_row_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    use_repo_cache(monkeypatch)
    grid, results = tmp_path / "micro.yaml", tmp_path / "results"
    grid.write_text(MICRO)
    results.mkdir()
    tune_row(load_grid(grid), "tiny", load_grid(grid).rows[0], 0, results, ladder=[4e-3, 8e-3], out=print)
    grid.write_text(MICRO.replace("max_steps: 8,", "max_steps: 10,"))  # the recipe changed since
    code = main(["stability", "--grid", str(grid), "--results", str(results), "--rows", "baseline"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith(
        "error: study micro-tiny-baseline-ladder holds trials of another config of row 'baseline'"
    )
    assert err.endswith(
        f"--study-name micro-tiny-baseline-ladder --storage sqlite:///{results.resolve()}/optuna.db"
    )


def test_a_grid_without_a_ladder_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    grid = tmp_path / "micro.yaml"
    grid.write_text(MICRO.replace("lr_ladder: [4e-3, 8e-3]\n", ""))
    code = main(["stability", "--grid", str(grid), "--results", str(tmp_path / "results")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == f"error: {grid}: lr_ladder: the grid declares no ladder; add one or give --ladder"


def test_the_ladder_trains_every_rung_records_divergence_and_a_rerun_trains_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    use_repo_cache(monkeypatch)
    original = LMModule.loss

    def planted(self: LMModule, batch, reduction: str = "mean"):
        loss = original(self, batch, reduction)
        return loss * float("nan") if self.training and self.cfg.train.max_lr > 4e-3 else loss

    monkeypatch.setattr(LMModule, "loss", planted)
    grid, results = tmp_path / "micro.yaml", tmp_path / "results"
    grid.write_text(MICRO)
    args = ["stability", "--grid", str(grid), "--results", str(results), "--rows", "baseline"]
    assert main(args) == 0
    table = pd.read_csv(results / "micro_lr_ladder.csv").iloc[0]
    assert table["loss@8e-03"] == math.inf  # the planted NaN: diverged, counted as L0
    assert table["largest_lr_that_trains"] == 4e-3
    assert table["lr_sensitivity"] == pytest.approx((math.log(512) - table["loss@4e-03"]) / 2, abs=1e-5)

    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny-lr")
    (trained,) = client.search_runs([exp.experiment_id], "tags.trial_state = 'complete'")
    assert trained.data.params["train.max_lr"] == "0.004"
    assert trained.data.metrics["val/loss"] == pytest.approx(table["loss@4e-03"], rel=1e-5)

    capsys.readouterr()
    assert main(args) == 0
    assert "2 of 2 trials done, 0 to run" in capsys.readouterr().out
    study = optuna.load_study(
        study_name="micro-tiny-baseline-ladder", storage=f"sqlite:///{results / 'optuna.db'}"
    )
    assert len(study.get_trials()) == 2  # nothing retrained
