"""Δ across the training budget (``make budget``, issue 31): the steps it reads, the paired Δs,
shares and sides recomputed by hand on three seeds, and the flattening criterion."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
from scipy import stats

from sweep.grid import load_grid
from sweep.report.budget import across_budget, budget_markdown, budget_table, flattened, fraction_steps, side
from sweep.report.curves import mean_curves
from tests.support import ROOT

STEPS = [100, 200, 300, 400, 500, 600, 700, 800]
#: Validation Avg PPL by (row, seed) at STEPS: G1 ahead early and late; q = 48 ahead only early.
VALUES = {
    ("baseline", 0): [600, 400, 300, 200, 150, 120, 110, 100.0],
    ("baseline", 1): [610, 410, 310, 205, 152, 121, 111, 101.0],
    ("baseline", 2): [590, 395, 305, 198, 149, 119, 109, 99.0],
    ("sdpa_elementwise", 0): [500, 350, 260, 180, 140, 112, 103, 94.0],
    ("sdpa_elementwise", 1): [505, 356, 268, 186, 141, 113, 104, 95.5],
    ("sdpa_elementwise", 2): [498, 345, 262, 177, 139, 110, 102, 93.0],
    ("q48", 0): [550, 380, 290, 190, 151, 121, 110, 100.5],
    ("q48", 1): [560, 390, 300, 199, 151, 120, 112, 100.0],
    ("q48", 2): [540, 370, 296, 190, 150, 120, 108, 99.5],
}


def curves() -> pd.DataFrame:
    return pd.DataFrame(
        [
            {"row": row, "seed": seed, "step": step, "value": v}
            for (row, seed), values in VALUES.items()
            for step, v in zip(STEPS, values)
        ]
    )


def hand_delta(row: str, base: str, at: int) -> tuple[float, float, float]:
    i = STEPS.index(at)
    diffs = [VALUES[(row, s)][i] - VALUES[(base, s)][i] for s in range(3)]
    mean = sum(diffs) / 3
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2)
    half = stats.t.ppf(0.975, 2) * sd / math.sqrt(3)
    return mean, mean - half, mean + half


def test_the_steps_are_the_validations_nearest_each_share_of_the_budget() -> None:
    assert fraction_steps(STEPS) == {0.25: 200, 0.5: 400, 1.0: 800}
    assert fraction_steps([100, 200, 300], (0.5,)) == {0.5: 100}  # 150 is as near 100 as 200: the earlier


def test_deltas_shares_and_sides_equal_a_hand_computation_at_each_step() -> None:
    grid = load_grid(ROOT / "grids" / "table1.yaml")
    table = budget_table(grid, "tiny", curves()).set_index(["id", "fraction"])
    assert sorted(table.index.get_level_values("id").unique()) == ["baseline", "q48", "sdpa_elementwise"]
    for fraction, step in {0.25: 200, 0.5: 400, 1.0: 800}.items():
        for row in ("sdpa_elementwise", "q48"):
            line = table.loc[(row, fraction)]
            assert line["step"] == step and line["n_seeds"] == 3
            d, lo, hi = hand_delta(row, "baseline", step)
            assert (line["delta_avg_ppl"], line["delta_ci95_low"], line["delta_ci95_high"]) == pytest.approx(
                (d, lo, hi)
            )
            g1 = hand_delta("sdpa_elementwise", "baseline", step)[0]
            assert line["share_of_gain"] == pytest.approx(d / g1)
        versus = hand_delta("q48", "sdpa_elementwise", step)
        line = table.loc[("q48", fraction)]
        assert (
            line["delta_vs_share"],
            line["delta_vs_share_low"],
            line["delta_vs_share_high"],
        ) == pytest.approx(versus)
    # the paper's Δ and share are its final ones, the same at every step
    assert table.loc[("sdpa_elementwise", 0.25), "paper_delta"] == pytest.approx(5.761 - 6.026)
    assert table.loc[("q48", 1.0), "paper_share_of_gain"] == pytest.approx((5.953 - 6.026) / (5.761 - 6.026))
    sides = {
        f: side(*table.loc[("q48", f), ["delta_avg_ppl", "delta_ci95_low", "delta_ci95_high"]])
        for f in (0.25, 0.5, 1.0)
    }
    assert sides == {0.25: "better", 0.5: "better", 1.0: "within noise"}
    assert across_budget(sides) == "better at 25, 50 %; within noise at 100 %"


def test_one_seed_gives_the_sign_without_an_interval() -> None:
    assert side(-3.0, math.nan, math.nan) == "better (no interval)"
    assert side(2.0, 1.0, 3.0) == "worse" and side(-1.0, -2.0, 0.5) == "within noise"
    assert side(math.nan, math.nan, math.nan) == "—"


def test_the_flattening_criterion_reads_the_baselines_last_tenth() -> None:
    grid = load_grid(ROOT / "grids" / "table1.yaml")
    mean = mean_curves(curves(), grid)
    fall, start, last = flattened(mean.loc["baseline"])
    assert (start, last) == (700, 800)  # 90 % of 800 is 720: the validation nearest it
    assert fall == pytest.approx(1 - 100 / 110)
    text = budget_markdown(grid, "tiny", budget_table(grid, "tiny", curves()), mean, "make budget", "")
    assert "fell 9.1% from step 700 to step 800" in text and "**still falling**" in text
    assert "| 3   | q = 48 (more query heads)" in text


def test_no_curves_is_an_error() -> None:
    grid = load_grid(ROOT / "grids" / "table1.yaml")
    with pytest.raises(ValueError, match="no finished run"):
        budget_table(grid, "tiny", pd.DataFrame(columns=["row", "seed", "step", "value"]))


def test_without_a_store_the_command_is_one_line_and_creates_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from sweep.cli import main

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    results = tmp_path / "results"
    assert main(["budget", "--grid", str(ROOT / "grids" / "table1.yaml"), "--results", str(results)]) == 2
    db = (results / "mlflow.db").resolve()
    expected = f"error: tracking store {db} is missing: nothing to report (make sweep first)\n"
    assert capsys.readouterr().err == expected
    assert list(results.iterdir()) == []


def test_rows_of_different_lengths_are_refused_in_one_line() -> None:
    grid = load_grid(ROOT / "grids" / "table1.yaml")
    short = curves()[~((curves()["row"] == "q48") & (curves()["step"] > 400))]
    with pytest.raises(
        ValueError, match=r"different numbers of steps \(baseline 800, q48 400, sdpa_elementwise 800\)"
    ):
        budget_table(grid, "tiny", short)


def test_a_missing_reference_point_or_row_gives_dashes_not_a_crash() -> None:
    grid = load_grid(ROOT / "grids" / "table1.yaml")
    found = curves()
    gapped = found[~((found["row"] == "q48") & (found["step"] == 400))]  # a validation not logged
    table = budget_table(grid, "tiny", gapped)
    assert set(table[table["id"] == "q48"]["fraction"]) == {0.25, 1.0}
    text = budget_markdown(grid, "tiny", table, mean_curves(gapped, grid), "make budget", "")
    assert "better at 25 %; — at 50 %; within noise at 100 %" in text
    alone = found[found["row"] != "baseline"]  # G1 and q = 48 finished, the baseline not yet
    text = budget_markdown(grid, "tiny", budget_table(grid, "tiny", alone), mean_curves(alone, grid), "x", "")
    assert "| 5   | SDPA elementwise (G1)" in text and "flattened" not in text


def test_too_few_validations_cannot_tell_and_one_step_is_read_once() -> None:
    grid = load_grid(ROOT / "grids" / "table1.yaml")
    two = curves()[curves()["step"] <= 200]
    table = budget_table(grid, "tiny", two)
    assert sorted(set(zip(table["fraction"], table["step"]))) == [(0.25, 100), (1.0, 200)]  # 25 and 50 %: 100
    mean = mean_curves(two, grid)
    assert math.isnan(flattened(mean.loc["baseline"])[0])
    assert "cannot be told" in budget_markdown(grid, "tiny", table, mean, "x", "")


def test_no_share_is_taken_of_a_gain_the_share_row_does_not_have() -> None:
    grid = load_grid(ROOT / "grids" / "table1.yaml")
    found = curves().copy()
    late = (found["row"] == "sdpa_elementwise") & (found["step"] == 800)
    found.loc[late, "value"] = [101.0, 99.0, 100.0]  # G1 within noise of the baseline at the end
    table = budget_table(grid, "tiny", found).set_index(["id", "fraction"])
    assert math.isnan(table.loc[("q48", 1.0), "share_of_gain"])
    assert not math.isnan(table.loc[("q48", 0.5), "share_of_gain"])
    assert side(0.0, math.nan, math.nan) == "same"
