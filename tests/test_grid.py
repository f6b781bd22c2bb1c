"""Grid parsing and validation: every shipped grid, and each kind of bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import ROOT

from experiments.model import parameter_count
from sweep.cli import main
from sweep.grid import GridError, load_grid, run_key

GRIDS = sorted((ROOT / "grids").glob("*.yaml"))

GOOD = """\
name: g
base:
  model: {vocab_size: 512, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, head_dim: 8,
          ffn_dim: 64, max_seq_len: 32}
  train: {max_steps: 6, batch_size: 4, seq_len: 32, warmup_steps: 2, val_every: 3, val_tokens: 256,
          max_lr: 2e-3}
  data: {vocab_size: 512}
scales: {tiny: {}}
rows:
  - {id: baseline}
  - {id: sdpa, model: {gate: {position: sdpa}}}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", GRIDS, ids=[p.name for p in GRIDS])
def test_shipped_grids_validate_at_every_scale(path: Path) -> None:
    grid = load_grid(path)
    for scale in grid.scales:
        assert grid.cells(scale)


def test_table1_has_the_papers_fifteen_rows_in_order() -> None:
    grid = load_grid(ROOT / "grids/table1.yaml")
    assert [r.paper_row for r in grid.rows] == list(range(1, 16))
    unsupported = [c.row.id for c in grid.cells("tiny") if c.unsupported]
    assert unsupported == ["add_experts"]  # row 4 needs the MoE base: reported, not dropped


def test_table1_added_params_at_paper_scale_match_the_paper() -> None:
    """Table 1's Added Param (M) column for rows 2-3 and 5-15, within the paper's rounding."""
    grid = load_grid(ROOT / "grids/table1.yaml")
    paper = {
        2: 50,
        3: 201,
        5: 201,
        6: 25,
        7: 25,
        8: 201,
        9: 100,
        10: 1.6,
        11: 0.2,
        12: 201,
        13: 25,
        14: 201,
        15: 201,
    }
    base = parameter_count(grid.baseline_config("paper").model)
    for cell in grid.cells("paper"):
        if cell.row.paper_row in paper:
            added = (parameter_count(cell.config.model) - base) / 1e6
            expected = paper[cell.row.paper_row]
            assert abs(added - expected) <= (0.05 if expected < 2 else 0.7), (cell.row.id, added, expected)


def test_scientific_notation_is_a_float(tmp_path: Path) -> None:
    cell = load_grid(write(tmp_path, GOOD)).cells("tiny")[0]
    assert cell.config.train.max_lr == 0.002


def test_relative_values_scale_the_scales_number(tmp_path: Path) -> None:
    text = GOOD + "  - {id: kv, model: {n_kv_heads: x2}}\n"
    cells = load_grid(write(tmp_path, text)).cells("tiny")
    assert cells[-1].config.model.n_kv_heads == 4


def test_run_key_is_stable_and_seed_sensitive(tmp_path: Path) -> None:
    grid = load_grid(write(tmp_path, GOOD))
    a, b = grid.cells("tiny", seeds=[0, 1])[:2]
    assert a.run_key == run_key(grid.resolve("tiny", a.row, 0)) and len(a.run_key) == 16
    assert a.run_key != b.run_key


BAD = {
    "malformed": (GOOD.replace("rows:", "rows: [", 1), "malformed YAML: line", None),
    "unknown_top_key": (GOOD + "colour: red\n", "colour: unknown key", None),
    "unknown_model_key": (
        GOOD + "  - {id: x, model: {n_layer: 3}}\n",
        "row 'x': model.n_layer: unknown key",
        None,
    ),
    "wrong_type": (
        GOOD + "  - {id: x, model: {n_layers: two}}\n",
        "row 'x': model.n_layers: must be an integer",
        None,
    ),
    "bad_enum": (
        GOOD + "  - {id: x, model: {gate: {position: output}}}\n",
        "row 'x': model.gate.position: bad value 'output'; allowed: sdpa, value, key, query, dense",
        None,
    ),
    "impossible_gqa": (
        GOOD + "  - {id: x, model: {n_kv_heads: 3}}\n",
        "row 'x': model.n_kv_heads: must divide n_heads=4",
        None,
    ),
    "impossible_relative": (
        GOOD + "  - {id: x, model: {n_heads: x1.3}}\n",
        "row 'x': model.n_heads: impossible shape",
        None,
    ),
    "duplicate_row": (GOOD + "  - {id: sdpa}\n", "row 'sdpa': id: duplicate row id", None),
    "duplicate_key": (
        GOOD + "  - id: x\n    model: {n_layers: 2, n_layers: 3}\n",
        "row 'x': model.n_layers: duplicate key 'n_layers'",
        None,
    ),
    "missing_base": (
        GOOD.split("base:")[0] + "scales:" + GOOD.split("scales:")[1],
        "base: missing required key 'base'",
        None,
    ),
    "empty_rows": (GOOD.split("rows:")[0] + "rows: []\n", "rows: must be a non-empty list of rows", None),
    "unknown_scale": (GOOD, "unknown scale 'huge'; defined: tiny", "huge"),
    "missing_inherited_grid": (GOOD + "inherit: nowhere.yaml\n", "inherit: inherited grid", None),
    "bad_table_column": (GOOD + "columns: [ppl]\n", "columns: must be a list of gate_score", None),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_grid_gives_one_line_exit_2_and_no_store(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    text, message, scale = BAD[case]
    path = write(tmp_path, text)
    results = tmp_path / "results"
    code = main(["sweep", "--grid", str(path), "--results", str(results), "--scale", scale or "tiny"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1
    assert err.startswith(f"error: {path}: ")
    assert message in err
    assert not results.exists()  # nothing started, nothing half-written


def test_grid_error_names_file_row_and_path(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD + "  - {id: x, train: {warmup_steps: 99}}\n")
    with pytest.raises(GridError) as err:
        load_grid(path)
    assert (err.value.file, err.value.row, err.value.path) == (str(path), "x", "train.warmup_steps")


def test_unknown_row_filter_is_rejected(tmp_path: Path) -> None:
    grid = load_grid(write(tmp_path, GOOD))
    with pytest.raises(GridError, match="unknown row id"):
        grid.cells("tiny", rows=["nope"])


def test_unwritable_results_folder_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    code = main(["sweep", "--grid", str(write(tmp_path, GOOD)), "--results", str(blocker / "results")])
    assert code == 2
    assert "results folder is not writable" in capsys.readouterr().err


def test_a_broken_scale_is_named_not_blamed_on_a_row(tmp_path: Path) -> None:
    text = GOOD.replace("scales: {tiny: {}}", "scales: {tiny: {}, odd: {model: {n_kv_heads: 3}}}")
    with pytest.raises(GridError) as err:
        load_grid(write(tmp_path, text))
    assert (err.value.row, err.value.path) == (None, "scales.odd.model.n_kv_heads")


def test_row_errors_name_the_scale(tmp_path: Path) -> None:
    text = GOOD.replace("scales: {tiny: {}}", "scales: {tiny: {}, wide: {model: {n_heads: 8}}}")
    text += "  - {id: kv3, model: {n_kv_heads: x3}}\n"  # 2 x 3 = 6 divides neither 4 nor 8
    with pytest.raises(
        GridError,
        match=r"row 'kv3': model.n_kv_heads: must divide n_heads=4 \(GQA\), got 6 \(at scale 'tiny'\)",
    ):
        load_grid(write(tmp_path, text))


@pytest.mark.parametrize("seeds", ["[0, 0]", "[-1]", "0", "[a]"])
def test_bad_seeds_are_rejected(tmp_path: Path, seeds: str) -> None:
    with pytest.raises(GridError, match="seeds: must be a positive count or a list of distinct integers"):
        load_grid(write(tmp_path, f"seeds: {seeds}\n" + GOOD))


def test_unknown_paper_table_is_rejected_before_training(tmp_path: Path) -> None:
    with pytest.raises(GridError, match="paper_table: unknown paper table 'table9'; known: architectures"):
        load_grid(write(tmp_path, "paper_table: table9\n" + GOOD))


def test_tables_3_and_4_inherit_table1s_model_and_scales() -> None:
    table1, table3, table4 = (load_grid(ROOT / "grids" / f"table{n}.yaml") for n in (1, 3, 4))
    for scale in ("tiny", "small", "paper"):
        base = table1.baseline_config(scale)
        assert table3.baseline_config(scale) == base and table4.baseline_config(scale) == base
    assert len(table3.rows) == len(table4.rows) == 7
    assert [r.paper_row for r in table4.rows] == list(range(1, 8))
    assert table4.columns == ("gate_score", "m_act", "f_attn")
    g = {r.id: table4.resolve("tiny", r, 0).model.gate for r in table4.rows}
    assert g["sdpa_input_independent"].input_dependent is False
    assert g["sdpa_ns_sigmoid"].activation == "ns_sigmoid"
    assert {r.id: table3.resolve("tiny", r, 0).model.gate.kind for r in table3.rows[4:6]} == {
        "sdpa_group_norm": "rmsnorm",
        "sdpa_silu": "silu",
    }
