"""A run's long-context scores are keyed by the grid's ``longctx:`` section as it was when they
were made (issue 54): Table 5's ``yarn_factor`` edited from 4 to 8 and a length added after the runs
were scored once made ``make eval`` score nothing while the table labelled the old factor's scores
with the new one. Now the edit rescores, and until then the tables leave the old scores out."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient

from experiments import names as N
from sweep.cli import main
from sweep.evalspec import LONGCTX_RULER_TAG, LONGCTX_TAG, LongContextSpec
from sweep.grid import load_grid
from sweep.report.longctx import build_longctx_table
from tests.support import MICRO, swept

STAGE = (
    '  - {id: baseline_long, label: "Baseline", parent: baseline, compare_to: baseline_long,\n'
    "     model: {rope_theta: 1000000.0, max_seq_len: x4}, train: {seq_len: x4, batch_size: x1/4}}\n"
)
FACTOR_4 = MICRO + STAGE + "longctx: {rows: [baseline_long], lengths: [1, 4], trials: 2, yarn_factor: 4.0}\n"
FACTOR_8 = FACTOR_4.replace("lengths: [1, 4]", "lengths: [1, 4, 8]").replace(
    "yarn_factor: 4.0", "yarn_factor: 8.0"
)


def test_the_recipe_changes_with_what_the_scores_are_made_with_not_with_which_rows() -> None:
    spec = LongContextSpec(rows=("a",), lengths=(1, 4), yarn_factor=4.0)
    same = [dataclasses.replace(spec, rows=("b",)), dataclasses.replace(spec, ruler_tasks=("vt",))]
    other = [
        dataclasses.replace(spec, yarn_factor=8.0),
        dataclasses.replace(spec, lengths=(1, 4, 8)),
        dataclasses.replace(spec, trials=3),
        dataclasses.replace(spec, ruler_limit=4),
    ]
    assert {s.recipe() for s in same} == {spec.recipe()}
    assert len({spec.recipe(), *(s.recipe() for s in other)}) == 5
    assert spec.current({LONGCTX_TAG: spec.recipe()})
    assert not spec.current({LONGCTX_TAG: "scored"})  # scored before the recipe was recorded: again
    ruler = dataclasses.replace(spec, ruler_tasks=("vt", "cwe"))
    assert not ruler.current({LONGCTX_TAG: spec.recipe(), LONGCTX_RULER_TAG: "vt"})  # cwe added since
    assert ruler.current({LONGCTX_TAG: spec.recipe(), LONGCTX_RULER_TAG: "cwe,vt"})


def test_the_table_shows_no_length_the_section_no_longer_lists(tmp_path: Path) -> None:
    """A run scored again keeps the metrics of a length since dropped: its new recipe tag must not
    vouch for them."""
    (tmp_path / "g.yaml").write_text(FACTOR_4)
    grid = load_grid(tmp_path / "g.yaml")
    scores = pd.DataFrame(
        [
            {
                "row": "baseline_long",
                "seed": 0,
                "task": "passkey",
                "length": length,
                "yarn": yarn,
                "value": 0.5,
            }
            for length in (32, 128, 256)  # 1, 4 and 8 x the micro context; the section lists 1 and 4
            for yarn in (False, True)
        ]
    )
    table = build_longctx_table(grid, "tiny", scores, None)
    assert sorted(set(table["length"])) == [32, 128]
    dropped = scores.assign(task="niah_single_1")  # a RULER task the section does not list
    assert build_longctx_table(grid, "tiny", dropped, None).empty


def _stage_two(results: Path):
    client = MlflowClient(f"sqlite:///{results / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny")
    (run,) = client.search_runs([exp.experiment_id], "tags.row = 'baseline_long'")
    return run


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    for run in swept(tmp_path_factory.mktemp("recipe"), FACTOR_4, "--rows", "baseline_long"):
        assert run["code"] == 0
        yield run


@pytest.mark.slow
def test_an_edited_yarn_factor_and_length_rescore_and_the_table_never_mislabels(
    scored: dict, capsys: pytest.CaptureFixture
) -> None:
    grid, results = scored["grid"], scored["results"]
    before = _stage_two(results)
    assert before.data.tags[LONGCTX_TAG] == load_grid(grid).longctx.recipe()
    old = before.data.metrics[N.longctx_key("ppl_avg", 128, True)]
    assert N.longctx_key("ppl_avg", 256) not in before.data.metrics

    grid.write_text(FACTOR_8)  # edited after the runs were scored
    capsys.readouterr()
    assert main(["tables", "--grid", str(grid), "--results", str(results)]) == 0
    text = (results / "micro.md").read_text()
    assert "No run of this grid at scale `tiny` has long-context scores yet" in text  # the x4 scores left out
    assert "YaRN factor 8, lengths 1, 4, 8 times" in text
    assert pd.read_csv(results / "micro.csv").empty

    assert main(["eval", "--grid", str(grid), "--results", str(results)]) == 0
    assert "long context: 1 runs scored, 0 failed" in capsys.readouterr().out
    after = _stage_two(results)
    assert after.data.tags[LONGCTX_TAG] == load_grid(grid).longctx.recipe() != before.data.tags[LONGCTX_TAG]
    new = after.data.metrics[N.longctx_key("ppl_avg", 128, True)]
    assert new != old  # YaRN x8, not x4
    assert (
        after.data.metrics[N.longctx_key("ppl_avg", 128)]
        == before.data.metrics[N.longctx_key("ppl_avg", 128)]
    )
    csv = pd.read_csv(results / "micro.csv")
    mine = csv[(csv["task"] == "ppl_avg") & csv["yarn"]].set_index("length")["mean"]
    assert sorted(mine.index) == [32, 128, 256] and mine[128] == pytest.approx(new)

    capsys.readouterr()
    assert main(["eval", "--grid", str(grid), "--results", str(results)]) == 0  # nothing left to score
    assert "long context:" not in capsys.readouterr().out
