"""Faults found by trying the harness as users do (issue 15): user names and paths that would be
misread as paths, URLs or queries; a report interrupted while it is written; a checkpoint that
does not fit on the disk; grid corner cases; metric names that are folders of one another; one
point per metric and step across a resume."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient

from experiments.checkpointing import AtomicCheckpointIO, CheckpointWriteError
from sweep.cli import main
from sweep.grid import load_grid
from sweep.gridfile import GridError
from sweep.store import quoted
from tests.support import MICRO, ROOT, swept, use_repo_cache

pytestmark = pytest.mark.slow  # make test-all: processes, signals, faults

GATED = "sdpa_elementwise"


def _client(results: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")


def _cell_runs(results: Path) -> list:
    client = _client(results)
    ids = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(ids, "tags.kind = 'cell'")


# --- 1. names and paths ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["abl/gates", "../up", ".hidden", "a b", "t'1", "x?y"])
def test_a_grid_name_that_is_not_a_file_name_is_refused_before_anything_is_written(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    grid = tmp_path / "g.yaml"
    grid.write_text(MICRO.replace("name: micro", f'name: "{name}"'))
    assert main(["sweep", "--grid", str(grid), "--results", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {grid}: name: must be letters, digits") and len(err.splitlines()) == 1
    assert not (tmp_path / "r").exists()


def test_a_scale_name_that_is_not_a_file_name_is_refused(tmp_path: Path) -> None:
    grid = tmp_path / "g.yaml"
    grid.write_text(MICRO.replace("scales: {tiny: {}}", 'scales: {tiny: {}, "gpu/a100": {}}'))
    with pytest.raises(GridError, match=r"scales\.gpu/a100: a scale name must be"):
        load_grid(grid)


@pytest.mark.parametrize("folder", ["exp?2", "run#1", "50%"])
def test_a_results_folder_a_database_url_would_misread_is_refused(
    folder: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``sqlite:///.../exp?2/mlflow.db`` is the database ``.../exp`` with a query ``2/mlflow.db``:
    a second folder ``exp?3`` would have shared it."""
    use_repo_cache(monkeypatch)
    grid = tmp_path / "g.yaml"
    grid.write_text(MICRO)
    for command in ("sweep", "tables", "tune"):
        assert main([command, "--grid", str(grid), "--results", str(tmp_path / folder)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {tmp_path / folder}: a folder whose path holds")
        assert "cannot hold a SQLite store" in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.yaml"]  # no store, no folder anywhere


def test_filter_values_are_quoted_or_refused() -> None:
    assert quoted("micro-tiny") == "'micro-tiny'"
    assert quoted("it's") == '"it\'s"'
    with pytest.raises(ValueError, match="both quote characters"):
        quoted("""'"'""")


@pytest.mark.parametrize(
    "row",
    [
        "{id: baseline, model: {[n_heads, n_kv_heads]: 4}}",
        "{id: baseline, [n_heads, n_kv_heads]: 4}",
        "{id: baseline, model: {{n_heads: 1}: 4}}",
        "{[id, label]: baseline}",
        "{id: baseline, model: {1: 4}}",
    ],
)
def test_a_yaml_complex_key_is_one_line_naming_the_place(row: str, tmp_path: Path) -> None:
    grid = tmp_path / "g.yaml"
    grid.write_text(MICRO.replace('{id: baseline, label: "Baseline", paper_row: 1}', row))
    with pytest.raises(GridError, match=r"keys must be names, not (a sequence|a mapping|'1') \(line 12 col"):
        load_grid(grid)


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_a_non_finite_number_is_refused_where_it_is_set(value: str, tmp_path: Path) -> None:
    grid = tmp_path / "g.yaml"
    grid.write_text(
        MICRO.replace(
            '{id: baseline, label: "Baseline", paper_row: 1}', f"{{id: baseline, train: {{max_lr: {value}}}}}"
        )
    )
    with pytest.raises(GridError, match=r"row 'baseline': train\.max_lr: must be a finite number"):
        load_grid(grid).cells("tiny")


def test_nested_aliases_cannot_hang_the_loader(tmp_path: Path) -> None:
    """ "Billion laughs": ten levels of nine aliases each would be 9^10 values to walk."""
    lines, previous = ["name: laughs", 'a: &a ["x", "x", "x", "x", "x", "x", "x", "x", "x"]'], "a"
    for name in "bcdefghijk":
        lines.append(f"{name}: &{name} [{', '.join(['*' + previous] * 9)}]")
        previous = name
    grid = tmp_path / "g.yaml"
    grid.write_text("\n".join(lines) + "\n")
    with pytest.raises(GridError, match="holds more than 100,000 values once its aliases are expanded"):
        load_grid(grid)


def test_a_grid_that_is_not_utf8_is_one_line(tmp_path: Path) -> None:
    grid = tmp_path / "g.yaml"
    grid.write_bytes(MICRO.encode().replace(b"name: micro", b"name: mi\xffcro"))
    with pytest.raises(GridError, match=r"g\.yaml: is not UTF-8 text \(byte 8 is 0xff\)$"):
        load_grid(grid)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("paper_row: 99", r"row 'baseline': paper_row: 99 is not a row of sweep/paper/table1_moe\.csv"),
        ("paper_row: 0", r"row 'baseline': paper_row: 0 is not a row"),
    ],
)
def test_row_values_a_table_could_not_use_are_refused(override: str, message: str, tmp_path: Path) -> None:
    grid = tmp_path / "g.yaml"
    grid.write_text(
        MICRO.replace('{id: baseline, label: "Baseline", paper_row: 1}', f"{{id: baseline, {override}}}")
    )
    with pytest.raises(GridError, match=message):
        load_grid(grid).cells("tiny")


def test_a_seed_outside_what_numpy_accepts_is_refused(tmp_path: Path) -> None:
    grid = tmp_path / "g.yaml"
    grid.write_text(MICRO.replace("name: micro", "name: micro\nseeds: [0, 4294967296]"))
    with pytest.raises(GridError, match=r"seed: must be in \[0, 2\^32\), got 4294967296"):
        load_grid(grid)


def test_a_label_with_a_pipe_or_a_line_break_keeps_the_markdown_table_whole() -> None:
    import pandas as pd

    from sweep.report.display import markdown_table

    text = markdown_table(pd.DataFrame({"Method": ["a | b", "two\nlines"], "PPL": ["1.0", "2.0"]}))
    header, rule, *rows = text.splitlines()
    assert rows[0].startswith("| a \\| b ") and rows[1].startswith("| two lines ")
    assert all(row.count(" | ") == header.count(" | ") for row in rows)


# --- 3. a report interrupted while it is written; a checkpoint that does not fit ------------------


@pytest.fixture(scope="module")
def reported(tmp_path_factory: pytest.TempPathFactory):
    """The gated micro row swept once (tables and figures written)."""
    yield from swept(tmp_path_factory.mktemp("report"), MICRO, "--rows", GATED)


def _report_files(results: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(results)): p.read_bytes()
        for p in sorted(results.rglob("*"))
        if p.is_file() and p.suffix in (".md", ".csv", ".tex", ".png")
    }


def test_ctrl_c_while_the_report_is_written_changes_no_file_and_a_rerun_completes_it(
    reported: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import sweep.report.write as write

    results = reported["results"]
    (results / "micro.md").write_text("the previous report\n")
    before = _report_files(results)
    assert "figures/micro_curves.png" in before

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt  # after the tables were staged, while the figures are drawn

    monkeypatch.setattr(write, "draw_curve_figures", interrupted)
    args = ["tables", "--grid", str(reported["grid"]), "--results", str(results)]
    assert main(args) == 130
    err = capsys.readouterr().err.strip()
    assert (
        err == "tables interrupted: no table or figure was half-written; run the same command again to finish"
    )
    assert _report_files(results) == before  # all or nothing: nothing
    assert not list(results.glob(".staging-*"))
    monkeypatch.undo()
    assert main(args) == 0
    after = _report_files(results)
    assert set(after) == set(before) and after["micro.md"] != before["micro.md"]


def test_a_store_that_refuses_the_report_copies_costs_one_line_not_the_tables(
    reported: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from sqlalchemy.exc import OperationalError

    from sweep.store import Tracker

    def read_only(self):  # what a read-only SQLite store raises on the first write
        raise OperationalError("UPDATE runs", {}, Exception("attempt to write a readonly database"))

    results = reported["results"]
    (results / "micro.md").write_text("the previous report\n")
    monkeypatch.setattr(Tracker, "report_run", read_only)
    assert main(["tables", "--grid", str(reported["grid"]), "--results", str(results)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "warning: the tables are written, but the tracking store refused their copies"
    )
    assert "attempt to write a readonly database" in err[0]
    assert (results / "micro.md").read_text().startswith("# ")  # written all the same


def test_a_staging_folder_left_by_a_killed_report_is_removed_by_the_next(reported: dict) -> None:
    from sweep.report.publish import _HOST

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    left = reported["results"] / f".staging-{dead.stdout.strip()}@{_HOST}-abc123"
    (left / "figures").mkdir(parents=True)
    (left / "micro.md").write_text("half a report")
    mine = reported["results"] / f".staging-{os.getpid()}@{_HOST}-live99"  # a live process's
    mine.mkdir()
    assert main(["tables", "--grid", str(reported["grid"]), "--results", str(reported["results"])]) == 0
    assert not left.exists() and mine.exists()
    mine.rmdir()


def test_a_checkpoint_over_the_file_size_limit_says_so_and_leaves_no_partial_file(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    path = tmp_path / "step000005.ckpt"
    (tmp_path / "step000000.ckpt").write_bytes(b"the previous checkpoint")
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))  # `ulimit -f 1024`; Python ignores SIGXFSZ
    try:
        with pytest.raises(CheckpointWriteError) as err:
            AtomicCheckpointIO().save_checkpoint({"w": torch.zeros(1 << 20)}, path)  # 4 MiB
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(err.value).startswith(
        "checkpoint step000005.ckpt not written: file too large: the file-size limit (ulimit -f) is 1.0 MiB ("
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step000000.ckpt"]


def test_a_sweep_whose_checkpoints_do_not_fit_fails_its_cells_with_the_reason(tmp_path: Path) -> None:
    """The example of the issue: ``ulimit -f 4096`` and a grid whose checkpoint is over 4 MB."""
    grid = tmp_path / "big.yaml"
    grid.write_text(
        MICRO.replace(
            "d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, head_dim: 8,",
            "d_model: 128, n_layers: 2, n_heads: 4, n_kv_heads: 2, head_dim: 32,",
        )
        .replace("ffn_dim: 64", "ffn_dim: 512")
        .replace("max_lr: 2e-3}", "max_lr: 2e-3, checkpoint_every: 5}")
    )
    env = {**os.environ, "GATED_ATTN_CACHE": str(ROOT / ".cache"), "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    results = tmp_path / "r"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sweep.cli",
            "sweep",
            "--grid",
            str(grid),
            "--results",
            str(results),
            "--rows",
            "baseline",
        ],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, resource.RLIM_INFINITY)),
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stdout + done.stderr
    assert (
        "FAILED: CheckpointWriteError: checkpoint step000005.ckpt not written: file too large" in done.stdout
    )
    assert not list((results / "checkpoints").rglob("*.tmp"))


# --- 6. two rows of one config ---------------------------------------------------------------------
def test_two_rows_of_one_config_train_once_and_both_show_the_result(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import pandas as pd

    use_repo_cache(monkeypatch)
    grid = tmp_path / "g.yaml"
    grid.write_text(
        MICRO.replace("  - {id: moe,", '  - {id: baseline_again, label: "Baseline again"}\n  - {id: moe,')
    )
    results = tmp_path / "r"
    assert (
        main(["sweep", "--grid", str(grid), "--results", str(results), "--rows", "baseline,baseline_again"])
        == 0
    )
    out = capsys.readouterr().out
    assert "note: rows baseline, baseline_again have one config at tiny: trained once, shown in each" in out
    assert "1 to train" in out and "finished 1, resumed 0, skipped 0" in out
    assert len(_cell_runs(results)) == 1
    table = pd.read_csv(results / "micro.csv").set_index("id")
    assert table.loc["baseline_again", "avg_ppl"] == table.loc["baseline", "avg_ppl"]
    assert table.loc["baseline_again", "vs_reference_last_half"] == "same"


# --- 7. metric names; 8. one point per step --------------------------------------------------------


@pytest.fixture(scope="module")
def killed_in_probes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The gated micro row killed (SIGKILL) during its final probes, then swept again."""
    tmp = tmp_path_factory.mktemp("probes")
    grid = tmp / "micro.yaml"
    grid.write_text(MICRO.replace("max_lr: 2e-3}", "max_lr: 2e-3, checkpoint_every: 5}"))
    results = tmp / "r"
    args = ["--grid", str(grid), "--results", str(results), "--rows", GATED]
    die = (
        "import os, signal\nfrom experiments.train import Training\n"
        "Training.probe = lambda self: os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "GATED_ATTN_CACHE": str(ROOT / ".cache"), "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    code = die + "import sys\nfrom sweep.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    killed = subprocess.run(
        [sys.executable, "-c", code, "sweep", *args], env=env, cwd=ROOT, capture_output=True
    )
    assert killed.returncode == -9
    mp = pytest.MonkeyPatch()
    use_repo_cache(mp)
    assert main(["sweep", *args]) == 0
    mp.undo()
    return results


def test_a_run_killed_in_its_final_probes_has_one_point_per_metric_and_step(killed_in_probes: Path) -> None:
    (run,) = _cell_runs(killed_in_probes)
    client = _client(killed_in_probes)
    for key in run.data.metrics:
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert len(steps) == len(set(steps)), f"{key}: {steps}"
    steps = {
        key: [m.step for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics
    }
    assert steps["params/total"] == [0] and steps["stability/loss_spikes"] == [8]
    assert steps["val/ppl/avg"] == [4, 8] and steps["sink/first_token_attn"] == [8]  # one convention
    assert steps["train/loss"] == list(range(8))


def test_no_metric_name_is_a_folder_of_another(killed_in_probes: Path) -> None:
    """MLflow's file store keeps a metric as a file named by its key: ``a/b`` and ``a/b/c`` cannot
    both exist."""
    (run,) = _cell_runs(killed_in_probes)
    names = set(run.data.metrics)
    assert "sink/first_token_attn.layer_00" in names and "gate/score_mean.layer_01" in names
    folders = {"/".join(k.split("/")[:i]) for k in names for i in range(1, k.count("/") + 1)}
    assert not names & folders


def test_a_cell_trains_on_mlflows_file_store_and_a_rerun_trains_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    use_repo_cache(monkeypatch)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    grid = tmp_path / "g.yaml"
    grid.write_text(MICRO)
    args = ["sweep", "--grid", str(grid), "--results", str(tmp_path / "r"), "--rows", GATED]
    assert main(args) == 0
    assert "finished 1" in capsys.readouterr().out
    assert main(args) == 0
    assert "0 to train" in capsys.readouterr().out
    assert list((tmp_path / "mlruns").rglob("metrics/sink/first_token_attn.layer_00"))
