"""Grid parsing and validation: every shipped grid, and each kind of bad input."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from experiments.config import RunConfig
from sweep.cli import main
from sweep.grid import GridError, load_grid, run_key
from sweep.gridfile import MAX_BYTES
from tests.support import GOOD, ROOT

GRIDS = sorted((ROOT / "grids").glob("*.yaml"))


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "grid.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("path", GRIDS, ids=[p.name for p in GRIDS])
def test_shipped_grids_validate_at_every_scale(path: Path) -> None:
    grid = load_grid(path)
    for scale in grid.scales:
        assert grid.cells(scale)


def test_table1_has_the_papers_fifteen_rows_in_order_and_the_constant_gate_control() -> None:
    grid = load_grid(ROOT / "grids/table1.yaml")
    assert [r.paper_row for r in grid.rows if r.paper_table is None] == list(range(1, 16))
    control = grid.rows[-1]
    assert (control.paper_table, control.paper_row) == ("table4_sparsity", 6)
    gate = grid.resolve("tiny", control, 0).model.gate
    assert gate.position == "sdpa" and not gate.input_dependent
    assert grid.share_of == "sdpa_elementwise"
    assert all(c.config.model.moe is not None for c in grid.cells("tiny"))  # every row on the MoE base


def test_table1_init_is_width_aware_below_the_papers_width_only() -> None:
    """Linear weights at 0.02 sqrt(2048 / d): 0.08 at tiny (d 128), 0.04 at small (d 512), 0.02 at paper."""
    grid = load_grid(ROOT / "grids/table1.yaml")
    stds = {s: grid.baseline_config(s).model.linear_init_std() for s in ("tiny", "small", "paper")}
    assert stds == pytest.approx({"tiny": 0.08, "small": 0.04, "paper": 0.02})


def test_table1_paper_scale_is_table7s_15a2b() -> None:
    """Table 7: 24 layers, 32 query / 4 KV heads of 128, d 2048, 128 experts of 768, top-8, untied.

    Total 15.58B is within 5% of the paper's "15B". Active is 1.99B, the "2B" of the name
    15A2B; the paper's text says 2.54B, which no count of Table 7's shape gives (docs/scales.md,
    "Parameters at the paper's scale")."""

    cfg = load_grid(ROOT / "grids/table1.yaml").baseline_config("paper").model
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_model) == (24, 32, 4, 128, 2048)
    assert (cfg.moe.n_experts, cfg.moe.top_k, cfg.moe.expert_dim, cfg.tie_embeddings) == (128, 8, 768, False)
    total, active = cfg.param_counts()
    embeddings = 2 * 151936 * 2048  # untied input and output
    attention = 2048 * (32 * 128) * 2 + 2048 * (4 * 128) * 2
    expert = 3 * 2048 * 768
    per_layer = attention + 2048 * 128 + 2 * 128 + 2 * 2048  # + router, qk-norm and block norms
    assert total == embeddings + 2048 + 24 * (per_layer + 128 * expert)
    assert active == total - 24 * (128 - 8) * expert
    assert abs(total / 15e9 - 1) < 0.05
    assert round(active / 1e9, 2) == 1.99


def test_table1_row4_adds_four_experts_in_total_and_per_token() -> None:
    """128 -> 132 experts, top-8 -> top-12 at paper and tiny scale: +453M total and active at
    paper scale (4 x 3 x 2048 x 768 x 24, plus 4 router rows per layer)."""

    grid = load_grid(ROOT / "grids/table1.yaml")
    for scale, experts in (("paper", (132, 12)), ("tiny", (132, 12))):
        (cell,) = grid.cells(scale, rows=["add_experts"])
        assert (cell.config.model.moe.n_experts, cell.config.model.moe.top_k) == experts
    base_total, base_active = grid.baseline_config("paper").model.param_counts()
    total, active = grid.cells("paper", rows=["add_experts"])[0].config.model.param_counts()
    added = 4 * 3 * 2048 * 768 * 24 + 4 * 2048 * 24
    assert (total - base_total, active - base_active) == (added, added)
    assert round(added / 1e6) == 453


def test_table2_rows_follow_the_papers_settings() -> None:
    """14 rows in the paper's order; layers 28 vs 48 (7 vs 12 at tiny), LR, batch and tokens."""
    import pandas as pd

    grid = load_grid(ROOT / "grids/table2.yaml")
    paper = pd.read_csv(ROOT / "sweep/paper/table2_dense.csv").set_index("row")
    assert [r.paper_row for r in grid.rows] == list(range(1, 15))
    tokens_per_400b = {"400B": 1, "3.5T": 35 / 4, "1T": 5 / 2}
    for scale, layers in (("paper", {28: 28, 48: 48}), ("tiny", {28: 7, 48: 12})):
        base = grid.baseline_config(scale).train
        for cell in grid.cells(scale):
            row = paper.loc[cell.row.paper_row]
            model, train = cell.config.model, cell.config.train
            assert model.n_layers == layers[row["layers"]], cell.row.id
            assert train.max_lr == pytest.approx(row["max_lr"]), cell.row.id
            assert train.batch_size / base.batch_size == row["batch"] / 1024, cell.row.id
            tokens = train.batch_size * train.max_steps / (base.batch_size * base.max_steps)
            assert tokens == pytest.approx(tokens_per_400b[row["tokens"]]), cell.row.id
            assert model.sandwich_norm == ("sandwich" in row["method"].lower()), cell.row.id
            gated = row["method"].startswith("SDPA")
            assert (model.gate is not None, model.match_params) == (gated, gated), cell.row.id
            if gated:
                expected = "headwise" if "headwise" in row["method"] else "elementwise"
                assert model.gate.granularity == expected, cell.row.id
    paper_28l = grid.baseline_config("paper").model
    assert (paper_28l.d_model, paper_28l.ffn_dim, paper_28l.tie_embeddings) == (2048, 6144, True)
    (deep,) = grid.cells("paper", rows=["baseline_48l"])
    assert (deep.config.model.d_model, deep.config.model.ffn_dim) == (1536, 4608)
    assert paper_28l.param_counts()[0] == 1_720_837_120  # the released 1.7B baseline checkpoint
    (gated,) = grid.cells("paper", rows=["sdpa_elementwise_28l"])
    assert gated.config.model.param_counts()[0] == 1_728_177_152  # the released elementwise one
    assert round(deep.config.model.param_counts()[0] / 1e9, 2) == 1.71
    references = {r.id: grid.reference(r).id for r in grid.rows}
    assert {r for r, ref in references.items() if r == ref} == {
        "baseline_28l", "baseline_28l_3t5", "baseline_48l", "baseline_48l_1t",
    }  # fmt: skip
    for row in grid.rows:  # every other row against the baseline of its own setting
        mine, ref = grid.cells("tiny", rows=[row.id])[0].config, grid.resolve("tiny", grid.reference(row), 0)
        assert (mine.model.n_layers, mine.train.batch_size, mine.train.max_steps) == (
            ref.model.n_layers, ref.train.batch_size, ref.train.max_steps,
        ), row.id  # fmt: skip


def test_fraction_multipliers_are_exact_and_must_give_whole_numbers(tmp_path: Path) -> None:
    ok = GOOD.replace("{id: sdpa, model: {gate: {position: sdpa}}}", "{id: sdpa, model: {n_layers: x3/2}}")
    assert load_grid(write(tmp_path, ok)).cells("tiny")[1].config.model.n_layers == 3
    bad = GOOD.replace("{id: sdpa, model: {gate: {position: sdpa}}}", "{id: sdpa, model: {n_layers: x12/7}}")
    with pytest.raises(GridError, match=r"row 'sdpa': model.n_layers: impossible shape: 2 x 12/7"):
        load_grid(write(tmp_path, bad))


def test_compare_to_must_name_a_row(tmp_path: Path) -> None:
    bad = GOOD.replace("{id: sdpa, model:", "{id: sdpa, compare_to: nowhere, model:")
    with pytest.raises(GridError, match=r"row 'sdpa': compare_to: names no row of the grid: 'nowhere'"):
        load_grid(write(tmp_path, bad))


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
    base = grid.baseline_config("paper").model.param_counts()[0]
    for cell in grid.cells("paper"):
        if cell.row.paper_row in paper and cell.row.paper_table is None:  # not the Table 4 control
            added = (cell.config.model.param_counts()[0] - base) / 1e6
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
    "html_in_a_label": (  # would pass into results/*.md as HTML
        GOOD + '  - {id: x, label: "<img src=x onerror=alert(1)>"}\n',
        "row 'x': label: must not hold '<', '>'",
        None,
    ),
    "unpaired_dollar_in_a_title": (
        GOOD.replace("name: g", "name: g\ntitle: costs $5"),
        "title: must not hold '$'",
        None,
    ),
    "malformed": (GOOD.replace("rows:", "rows: [", 1), "malformed YAML: line", None),
    "paper_table_of_another_layout": (  # used to train every cell, then crash in the report
        GOOD.replace("scales:", "paper_table: table5_ruler\nscales:"),
        "paper_table: sweep/paper/table5_ruler.csv has no 'row' column",
        None,
    ),
    "row_paper_table_of_another_layout": (
        GOOD + "  - {id: x, paper_table: table5_ruler}\n",
        "row 'x': paper_table: sweep/paper/table5_ruler.csv has no 'row' column",
        None,
    ),
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
        "base: missing required key",
        None,
    ),
    "empty_rows": (GOOD.split("rows:")[0] + "rows: []\n", "rows: must be a non-empty list of rows", None),
    "unknown_scale": (GOOD, "unknown scale 'huge'; defined: tiny", "huge"),
    "missing_inherited_grid": (GOOD + "inherit: nowhere.yaml\n", "inherit: inherited grid", None),
    "bad_table_column": (
        GOOD + "columns: [ppl]\n",
        "columns[0]: bad value 'ppl'; allowed: gate_score, gate_frac_below, m_act, f_attn, f_attn_late, "
        "loss_spikes, logit_std_init, branch_scale_init",
        None,
    ),
    "complex_key": (
        GOOD + "  - {id: x, model: {[n_heads, n_kv_heads]: 4}}\n",
        "row 'x': model: keys must be names, not a sequence",
        None,
    ),
    "unknown_row_key": (GOOD + "  - {id: x, requires: [moe]}\n", "row 'x': requires: unknown key", None),
    "bad_row_id": (GOOD + "  - {id: X-1}\n", "rows[2].id: needs an 'id' of [a-z0-9_]", None),
    "bad_eval": (GOOD + "eval: {tasks: [a], num_fewshot: {b: 1}}\n", "eval.num_fewshot.b: must map", None),
    "unordered_lr_ladder": (
        GOOD + "lr_ladder: [1e-2, 1e-3]\n",
        "lr_ladder: must be distinct positive LRs in increasing order, got [0.01, 0.001]",
        None,
    ),
    "lr_ladder_below_min_lr": (
        GOOD + "lr_ladder: [1e-5, 1e-2]\n",
        "row 'baseline': lr_ladder: rung 1e-05 is below train.min_lr 3e-05 (at scale 'tiny')",
        None,
    ),
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


UNTRAINABLE = [  # (section, key, value): each trained to a failed or meaningless run before
    ("train", "grad_clip", -1),  # reversed every gradient, recorded "done"
    ("train", "beta1", 1.5),
    ("train", "beta2", 1.0),
    ("train", "weight_decay", -0.1),
    ("model", "norm_eps", -1),  # recorded as a diverged result
    ("model", "norm_eps", 0),
    ("model", "rope_theta", 0),
    ("model", "rope_theta", 1),
    ("model", "init_std", -0.02),
    ("model", "max_seq_len", 0),
    ("train", "max_lr", 0),  # was blamed on min_lr
    ("train", "max_lr", -0.001),
    ("train", "max_steps", 10**29),  # loaded, then failed its cell in numpy
]


@pytest.mark.parametrize(
    ("section", "key", "value"), UNTRAINABLE, ids=[f"{k}={v}" for _, k, v in UNTRAINABLE]
)
def test_a_value_that_cannot_train_is_refused_at_grid_load(
    section: str, key: str, value: float, tmp_path: Path
) -> None:
    path = write(tmp_path, GOOD + f"  - {{id: x, {section}: {{{key}: {value}}}}}\n")
    with pytest.raises(GridError) as err:
        load_grid(path)
    assert (err.value.file, err.value.row, err.value.path) == (str(path), "x", f"{section}.{key}")
    assert str(value) in str(err.value) or f"{value:,}" in str(err.value)


def test_a_grid_path_that_is_not_a_regular_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    fifo = tmp_path / "grid.yaml"
    os.mkfifo(fifo)  # reading it would block until a writer came
    code = main(["sweep", "--grid", str(fifo), "--results", str(tmp_path / "results")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err == f"error: {fifo}: is not a regular file (a grid is a YAML file)"
    assert not (tmp_path / "results").exists()


def test_a_grid_larger_than_the_bound_is_refused_unread(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD + "#" * MAX_BYTES + "\n")
    with pytest.raises(GridError, match=f"is larger than {MAX_BYTES:,} bytes"):
        load_grid(path)


def test_yaml_merge_keys_copy_an_anchored_mapping(tmp_path: Path) -> None:
    text = GOOD.replace(
        "  - {id: sdpa, model: {gate: {position: sdpa}}}",
        "  - {id: sdpa, model: {gate: &g {position: sdpa, activation: silu}}}\n"
        "  - {id: value, model: {gate: {<<: *g, position: value}}}",
    )
    cells = {c.row.id: c for c in load_grid(write(tmp_path, text)).cells("tiny")}
    gate = cells["value"].config.model.gate
    assert (gate.position, gate.activation) == ("value", "silu")  # merged, then overridden


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


@pytest.mark.parametrize("seeds", ["[0, 0]", "[-1]", "0", "[a]", "100000000", str(list(range(1001)))])
def test_bad_seeds_are_rejected(tmp_path: Path, seeds: str) -> None:
    with pytest.raises(
        GridError, match="seeds: must be a count of 1 to 1000 or a list of at most 1000 distinct"
    ):
        load_grid(write(tmp_path, f"seeds: {seeds}\n" + GOOD))  # 10^8 seeds hung, filling the memory


def test_too_many_seeds_on_the_command_line_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["sweep", "--grid", str(write(tmp_path, GOOD)), "--seeds", "100000000"]) == 2
    assert capsys.readouterr().err == "error: --seeds must be 1 to 1000, got 100000000\n"


GRIDS_YAML_CANNOT_READ = {  # (text, the one line's end): each was a traceback
    "nul": ("name: x\n\0\n", "malformed YAML: line 2: character U+0000 is not allowed"),
    "deep": ("x: " + "[" * 600 + "]" * 600 + "\n", "is nested too deeply (a grid needs a few levels)"),
    "huge int": ("name: " + "9" * 5000 + "\n", "malformed YAML: Exceeds the limit (4300 digits) for integer"),
}


@pytest.mark.parametrize("case", GRIDS_YAML_CANNOT_READ)
def test_yaml_python_cannot_read_is_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    text, end = GRIDS_YAML_CANNOT_READ[case]
    path = tmp_path / "grid.yaml"
    path.write_text(text)
    assert main(["params", "--grid", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: {end}") and err.count("\n") == 1


def test_deep_nesting_is_refused_whatever_the_recursion_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # torch's compiler raises Python's recursion limit for the whole process; under it PyYAML
    # composed 600 levels and the file read "is not a grid" (CI's test-all, after the compile tests)
    text, end = GRIDS_YAML_CANNOT_READ["deep"]
    path = tmp_path / "grid.yaml"
    path.write_text(text)
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)
    try:
        assert main(["params", "--grid", str(path)]) == 2
    finally:
        sys.setrecursionlimit(limit)
    assert capsys.readouterr().err == f"error: {path}: {end}\n"


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


def test_where_a_cell_trains_is_not_part_of_what_it_is(tmp_path: Path) -> None:
    """Devices, nodes and strategy are placement: the same cell on a laptop and on a cluster has one
    run_key (and one result); a science field changes it."""
    import sys

    text = (
        GOOD + "  - {id: two_gpus, train: {devices: 2, strategy: ddp}}\n  - {id: lr, train: {max_lr: 3e-3}}\n"
    )
    cells = {c.row.id: c for c in load_grid(write(tmp_path, text)).cells("tiny")}
    assert cells["two_gpus"].run_key == cells["baseline"].run_key
    assert cells["lr"].run_key != cells["baseline"].run_key
    if sys.version_info[:2] == (3, 11):  # the corpus recipe hashes the stdlib's Python version
        # The default config's key at numbers version 2 (the pinned CPU arithmetic): a change to
        # how keys are made (a new field, say) orphans every stored result and must be deliberate.
        assert run_key(RunConfig()) == "b241055fcc64b992"


def test_a_cell_on_several_machines_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    path = write(tmp_path, GOOD + "  - {id: two, train: {num_nodes: 2}}\n")
    code = main(["sweep", "--grid", str(path), "--results", str(tmp_path / "results")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"error: {path}: row 'two': train.num_nodes: num_nodes = 2: a cell on several")
    assert not (tmp_path / "results").exists()


def test_a_results_path_that_is_a_file_says_so(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    blocker = tmp_path / "results"
    blocker.write_text("not a folder")
    assert main(["tables", "--grid", str(write(tmp_path, GOOD)), "--results", str(blocker)]) == 2
    assert (
        capsys.readouterr().err
        == f"error: {blocker}: the results folder is a file; name a folder (--results)\n"
    )
