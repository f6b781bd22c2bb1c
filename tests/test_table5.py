"""Table 5 end to end on the micro grid: two stages, the long-context evaluation of the stage-2 rows
by length with and without YaRN, and the report in the paper's layout (real runs, real corpus)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient

from experiments import names as N
from sweep.cli import main
from sweep.grid import load_grid
from sweep.gridfile import GridError
from sweep.report.longctx import build_longctx_table, gap_block, task_block
from tests.support import MICRO, swept

STAGES = (
    '  - {id: baseline_long, label: "Baseline", parent: baseline, compare_to: baseline_long,\n'
    "     model: {rope_theta: 1000000.0, max_seq_len: x4}, train: {seq_len: x4, batch_size: x1/4}}\n"
    '  - {id: gated_long, label: "SDPA gate", parent: sdpa_elementwise, compare_to: baseline_long,\n'
    "     model: {rope_theta: 1000000.0, max_seq_len: x4}, train: {seq_len: x4, batch_size: x1/4}}\n"
    "longctx: {rows: [baseline_long, gated_long], lengths: [1, 4, 8], trials: 2}\n"
)
TABLE5 = MICRO.replace("paper_table: table1_moe", "paper_table: table5_ruler") + STAGES
ROWS = ("baseline_long", "gated_long")
LENGTHS = (32, 128, 256)  # 1, 4 and 8 x the micro context


@pytest.fixture(scope="module")
def table5(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    for run in swept(tmp_path_factory.mktemp("table5"), TABLE5, "--rows", ",".join(ROWS)):
        assert run["code"] == 0
        yield run


def stage_runs(results: Path) -> dict[str, object]:
    client = MlflowClient(f"sqlite:///{results / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny")
    runs = client.search_runs([exp.experiment_id], "tags.kind = 'cell'")
    return {r.data.tags["row"]: r for r in runs}


def test_every_stage_two_run_has_scores_at_every_length_with_and_without_yarn(table5: dict) -> None:
    runs = stage_runs(table5["results"])
    for row in ROWS:
        metrics = runs[row].data.metrics
        for length in LENGTHS:
            for yarn in (False, True):
                for task in ("ppl_avg", "f_attn", "f_attn_ratio"):
                    assert math.isfinite(metrics[N.longctx_key(task, length, yarn)]), (
                        row,
                        task,
                        length,
                        yarn,
                    )
        # the passkey prompt (needle, filler, question) needs more than 32 tokens: scored from 128 on
        assert 0 <= metrics[N.longctx_key("passkey", 256, True)] <= 1
        assert N.longctx_key("passkey", 32) not in metrics
    # stage-1 rows are not in longctx.rows: trained, not scored by length
    assert not any(k.startswith("longctx/") for k in runs["baseline"].data.metrics)


def test_tables_write_table5_in_the_papers_layout(table5: dict) -> None:
    results = table5["results"]
    assert main(["tables", "--grid", str(table5["grid"]), "--results", str(results)]) == 0
    csv = pd.read_csv(results / "micro.csv")
    for row in ROWS:
        for yarn in (False, True):
            mine = csv[(csv["row"] == row) & (csv["yarn"] == yarn) & (csv["task"] == "ppl_avg")]
            assert sorted(mine["length"]) == list(LENGTHS) and mine["mean"].notna().all()
    md = (results / "micro.md").read_text()
    assert "SDPA gate (YaRN)" in md and "## passkey" in md and "## ppl_avg" in md
    assert "The paper's Table 5" in md and "72.88" in md  # SDPA gate (YaRN) at 1x its context
    assert (results / "micro.tex").read_text().count("YaRN") == 2
    assert (results / "figures" / "micro_longctx.png").stat().st_size > 10_000


def test_a_second_sweep_trains_nothing(table5: dict, capsys: pytest.CaptureFixture) -> None:
    capsys.readouterr()
    args = [
        "sweep",
        "--grid",
        str(table5["grid"]),
        "--results",
        str(table5["results"]),
        "--rows",
        ",".join(ROWS),
    ]
    assert main(args) == 0
    assert "finished 0, resumed 0, skipped 4" in capsys.readouterr().out


def test_yarn_change_and_gap_are_paired_by_seed_by_hand(tmp_path: Path) -> None:
    (tmp_path / "g.yaml").write_text(TABLE5)
    grid = load_grid(tmp_path / "g.yaml")
    values = {  # (row, yarn) -> per-seed passkey at 128 tokens
        ("baseline_long", False): [0.9, 0.8, 0.7],
        ("baseline_long", True): [0.5, 0.6, 0.4],
        ("gated_long", False): [0.9, 0.9, 0.8],
        ("gated_long", True): [0.85, 0.8, 0.8],
    }
    scores = pd.DataFrame(
        [
            {"row": row, "seed": seed, "task": "passkey", "length": 128, "yarn": yarn, "value": v}
            for (row, yarn), vs in values.items()
            for seed, v in enumerate(vs)
        ]
    )
    table = build_longctx_table(grid, "tiny", scores, None).set_index(["row", "yarn"])
    assert table.loc[("baseline_long", True), "yarn_change"] == pytest.approx(-0.3)  # mean of -.4 -.2 -.3
    assert table.loc[("gated_long", True), "yarn_change"] == pytest.approx(-0.05)  # -.05 -.1 0
    gap = table.loc[("gated_long", True)]
    assert gap["gap"] == pytest.approx(0.25)  # the gated row fell 0.25 less
    diffs = [-0.05 + 0.4, -0.1 + 0.2, 0 + 0.3]
    half = 4.302652729911275 * pd.Series(diffs).std() / math.sqrt(3)  # t(0.975, 2)
    assert (gap["gap_low"], gap["gap_high"]) == pytest.approx((gap["gap"] - half, gap["gap"] + half))
    assert table.loc[("gated_long", True), "ratio"] == 1.0  # 128 tokens = the stage-2 context
    block = task_block(table.reset_index(), "passkey")
    assert list(block["Method"]) == ["Baseline", "SDPA gate", "Baseline (YaRN)", "SDPA gate (YaRN)"]
    assert block.loc[2, "128"] == "0.500 ± 0.100 (-0.300)"
    assert gap_block(table.reset_index(), "passkey").iloc[0, 0] == "SDPA gate vs Baseline"


@pytest.mark.parametrize(
    ("section", "key", "message"),
    [
        ("{rows: [nowhere]}", "longctx.rows", "names no row of the grid: 'nowhere'"),
        ("{lengths: [0]}", "longctx.lengths", "integers >= 1"),
        ("{yarn_factor: 0.5}", "longctx.yarn_factor", "must be >= 1"),
        ("{ruler_tasks: [niah_single_2]}", "longctx.ruler_tasks", "unknown niah_single_2"),
    ],
)
def test_a_bad_longctx_section_is_one_line(tmp_path: Path, section: str, key: str, message: str) -> None:
    (tmp_path / "g.yaml").write_text(MICRO + f"longctx: {section}\n")
    with pytest.raises(GridError) as err:
        load_grid(tmp_path / "g.yaml")
    assert key in str(err.value) and message in str(err.value) and "\n" not in str(err.value)


def test_the_shipped_table5_grid_keeps_the_recipe() -> None:
    grid = load_grid(Path(__file__).resolve().parents[1] / "grids" / "table5.yaml")
    for scale in grid.scales:
        cells = {c.row.id: c for c in grid.cells(scale, seeds=[0])}
        for stage1, stage2 in (("baseline", "baseline_long"), ("sdpa_elementwise", "sdpa_elementwise_long")):
            one, two = cells[stage1].config, cells[stage2].config
            assert cells[stage2].parent is cells[stage1]
            assert (
                two.train.seq_len == 4 * one.train.seq_len
                and two.model.max_seq_len == 4 * one.model.max_seq_len
            )
            assert two.model.rope_theta == 100 * one.model.rope_theta == 1e6
            assert two.train.seq_len * two.train.batch_size == one.train.seq_len * one.train.batch_size
        assert cells["sdpa_elementwise_long"].config.model.gate.position == "sdpa"
    assert grid.longctx.rows == ("baseline_long", "sdpa_elementwise_long") and grid.longctx.yarn_factor == 4.0


def test_ruler_tasks_without_the_extra_warn_and_leave_the_other_scores(table5: dict) -> None:
    from sweep.eval.longctx_run import score_missing_long_context
    from sweep.eval.ruler import missing_packages
    from sweep.store import Tracker
    from sweep.store_urls import tracking_uri

    if not missing_packages():
        pytest.skip("the ruler extra is installed here")
    grid_file = table5["grid"].parent / "ruler.yaml"
    grid_file.write_text(TABLE5.replace("trials: 2}", "trials: 2, ruler_tasks: [niah_single_1]}"))
    grid = load_grid(grid_file)
    results = table5["results"]
    tracker = Tracker(tracking_uri(results), "micro-tiny", results / "mlartifacts")
    lines: list[str] = []
    assert score_missing_long_context(tracker, grid, grid.cells("tiny"), out=lines.append) == (0, 0)
    assert len(lines) == 1 and "longctx.ruler_tasks not scored" in lines[0] and ".[ruler]" in lines[0]


def test_tables_of_table5_on_an_empty_store_say_no_run_has_scores(tmp_path: Path) -> None:
    grid = Path(__file__).parent.parent / "grids" / "table5.yaml"
    assert main(["tables", "--grid", str(grid), "--results", str(tmp_path)]) == 0
    text = (tmp_path / "table5.md").read_text()
    assert "No run of this grid at scale `tiny` has long-context scores yet" in text
    frame = pd.read_csv(tmp_path / "table5.csv")
    assert frame.empty and list(frame.columns)[:5] == ["row", "label", "task", "length", "yarn"]


def test_a_sweep_of_table5s_first_stage_alone_ends_with_its_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    for run in swept(tmp_path, TABLE5, "--rows", "baseline"):  # no stage-2 row: no long-context score
        assert run["code"] == 0
        out = capsys.readouterr().out
        assert "sweep finished in" in out and "finished 1, resumed 0, skipped 0" in out
        assert (
            "No run of this grid at scale `tiny` has long-context scores yet"
            in (run["results"] / "micro.md").read_text()
        )
