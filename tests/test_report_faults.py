"""The report after the cells trained: it never replaces a table made from runs with an empty one
because the store went missing, never leaves an earlier report's curves or figures beside a table
that no longer has them, and a figure it cannot draw costs one warning, not the tables."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient

from sweep.cli import main
from tests.support import MICRO, swept

pytestmark = pytest.mark.slow  # make test-all: processes, signals, faults


@pytest.fixture(scope="module")
def reported(tmp_path_factory: pytest.TempPathFactory):
    """The baseline and the gated micro row swept once (tables and figures written)."""
    yield from swept(tmp_path_factory.mktemp("report"), MICRO, "--rows", "baseline,sdpa_elementwise")


def copy_of(reported: dict, tmp_path: Path) -> tuple[list[str], Path]:
    results = tmp_path / "results"
    shutil.copytree(reported["results"], results)
    return ["--grid", str(reported["grid"]), "--results", str(results)], results


def report_files(results: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(results)): p.read_bytes()
        for p in sorted(results.rglob("*"))
        if p.is_file() and p.suffix in (".md", ".csv", ".tex", ".png", ".json") and ".staging" not in str(p)
    }


@pytest.mark.parametrize("how", ["deleted", "emptied"])
@pytest.mark.parametrize("command", ["tables", "eval"])
def test_a_lost_store_does_not_replace_the_tables_with_empty_ones(
    how: str, command: str, reported: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args, results = copy_of(reported, tmp_path)
    db = results / "mlflow.db"
    db.unlink() if how == "deleted" else db.write_bytes(b"")
    before = report_files(results)
    assert main([command, *args]) == 2
    err = capsys.readouterr().err
    missing = "missing" if how == "deleted" else "empty"
    assert err == (
        f"error: tracking store {db.resolve()} is {missing}, but {results / 'micro.md'} was made from 2 "
        "run(s): not replaced by an empty table (restore the store, or delete micro.md to write one)\n"
    )
    assert report_files(results) == before
    assert db.exists() == (how == "emptied")  # no store created either

    (results / "micro.md").unlink()  # the user's choice: an empty table
    assert main(["tables", *args]) == 0
    assert "| not run |" in (results / "micro.md").read_text()


def test_curves_and_figures_of_runs_since_gone_are_removed_with_the_new_report(
    reported: dict, tmp_path: Path
) -> None:
    args, results = copy_of(reported, tmp_path)
    assert (results / "micro_curves.md").is_file() and (results / "figures/micro_curves.png").is_file()
    client = MlflowClient(f"sqlite:///{results / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny")
    for run in client.search_runs([exp.experiment_id], "tags.kind = 'cell'"):
        client.delete_run(run.info.run_id)  # as in the UI
    assert main(["tables", *args]) == 0
    assert "| not run |" in (results / "micro.md").read_text()
    assert not (results / "micro_curves.md").exists() and not (results / "micro_curves.csv").exists()
    assert list((results / "figures").glob("micro_*.png")) == []
    assert not list(results.glob(".staging-*"))


def test_a_figure_that_cannot_be_drawn_is_one_warning_and_the_tables_are_written(
    reported: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import sweep.report.write as write

    args, results = copy_of(reported, tmp_path)
    (results / "micro.md").write_text("the previous report\n")

    def gate_metric_gone(*_args, **_kwargs):  # a run whose gate/score_mean was deleted
        raise KeyError("gate/score_mean")

    monkeypatch.setattr(write, "draw_figures", gate_metric_gone)
    assert main(["tables", *args]) == 0
    err = capsys.readouterr().err
    assert err == "warning: figures not drawn: KeyError: 'gate/score_mean'\n"
    assert (results / "micro.md").read_text().startswith("# ")
    assert (results / "figures/micro_curves.png").is_file()  # the curve figures are drawn all the same


def test_a_report_that_cannot_be_moved_into_place_leaves_no_staging_folder(
    reported: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    args, results = copy_of(reported, tmp_path)
    (results / "micro.md").unlink()
    (results / "micro.md").mkdir()  # a folder where the table goes
    assert main(["tables", *args]) != 0
    assert not list(results.glob(".staging-*"))


def test_sigterm_while_the_report_is_written_is_one_line_and_143(
    reported: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import os
    import signal

    import sweep.report.write as write

    args, results = copy_of(reported, tmp_path)
    before = report_files(results)

    def terminated(*_args, **_kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's, while the figures are drawn

    monkeypatch.setattr(write, "draw_figures", terminated)
    assert main(["tables", *args]) == 143
    assert capsys.readouterr().err == (
        "tables stopped by SIGTERM: no table or figure was half-written; "
        "run the same command again to finish\n"
    )
    assert report_files(results) == before and not list(results.glob(".staging-*"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back as it was


def test_ctrl_c_in_compare_is_one_line_and_130(
    reported: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import sweep.browse as browse
    import sweep.report.compare

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep.report.compare, "write_compare", interrupted)
    args = ["compare", "--grid", str(reported["grid"]), "--results", str(reported["results"])]
    assert browse.main([*args, "--runs", "baseline,sdpa_elementwise"]) == 130
    assert capsys.readouterr().err == "compare interrupted\n"


@pytest.mark.parametrize("command", ["compare", "ui"])
def test_browsing_a_missing_store_does_not_create_an_empty_one(
    command: str, reported: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """An empty store made by ``make compare`` once let ``make tables`` wipe the table."""
    from sweep.browse import main as browse

    args, results = copy_of(reported, tmp_path)
    (results / "mlflow.db").unlink()
    more = ["--runs", "baseline,sdpa_elementwise"] if command == "compare" else ["--print-only"]
    assert browse([command, *args, *more]) == 2
    db = (results / "mlflow.db").resolve()
    assert (
        capsys.readouterr().err
        == f"error: tracking store {db} is missing: nothing to browse (make sweep makes it)\n"
    )
    assert not db.exists()
    assert main(["tables", *args]) == 2  # and the table made from the runs stays
