"""A password in a storage URL reaches no output, file, artifact or command line: printed lines
and the tables' command show ``***``, and workers get the URL through their environment."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sweep.cli import main
from sweep.passwords import hide_password
from sweep.run.driver import start_processes
from sweep.signals import StopRequest
from sweep.store_urls import STORAGE_ENV
from tests.support import MICRO

SECRET = "S3cr-t_pw"
URL = f"postgresql+psycopg://alice:{SECRET}@db.example:5432/sweeps"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (URL, "postgresql+psycopg://alice:***@db.example:5432/sweeps"),
        (
            f"--storage '{URL}' --rows a",
            "--storage 'postgresql+psycopg://alice:***@db.example:5432/sweeps' --rows a",
        ),
        ("mysql://bob:pw@h/db and http://u:p@x:80/y", "mysql://bob:***@h/db and http://u:***@x:80/y"),
        ("sqlite:////tmp/results/optuna.db", "sqlite:////tmp/results/optuna.db"),  # nothing to hide
        ("postgresql://alice@host/db", "postgresql://alice@host/db"),  # a user, no password
        (
            "postgresql://alice@h:1/db?password=pw&sslmode=require",
            "postgresql://alice@h:1/db?password=***&sslmode=require",
        ),
        ("https://u:pw@h/?token=t0k&x=1 done", "https://u:***@h/?token=***&x=1 done"),
    ],
)
def test_hide_password_replaces_only_the_password(text: str, shown: str) -> None:
    assert hide_password(text) == shown


def test_a_storage_password_reaches_no_worker_command_line_table_or_printed_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import sweep.run.driver as driver

    seen: dict = {}

    def queued(grid, cells, results, workers, url, worker_args, *rest, **kwargs):  # no server here
        seen.update(url=url, worker_args=worker_args)
        return []

    monkeypatch.setattr(driver, "run_queued_sweep", queued)
    grid = tmp_path / "micro.yaml"
    grid.write_text(MICRO)
    results = tmp_path / "results"
    argv = ["sweep", "--grid", str(grid), "--results", str(results), "--workers", "2", "--storage", URL]
    monkeypatch.setattr(sys, "argv", ["sweep.cli", *argv])  # what the tables name as their command
    assert main(argv) == 0
    assert seen["url"] == URL  # the driver uses it ...
    assert SECRET not in " ".join(seen["worker_args"])  # ... and does not put it in the workers' command
    captured = capsys.readouterr()
    assert SECRET not in captured.out + captured.err
    written = [p for p in results.rglob("*") if p.is_file() and p.suffix in (".md", ".csv", ".tex", ".json")]
    assert written and not [p for p in written if SECRET in p.read_text()]
    assert "alice:***@db.example" in (results / "micro.md").read_text()


def test_worker_processes_get_the_storage_url_in_their_environment(tmp_path: Path) -> None:
    lines: list[str] = []
    check = f"import os, sys; sys.exit(0 if os.environ.get('{STORAGE_ENV}') == {URL!r} else 3)"
    names = start_processes([sys.executable, "-c", check], 2, StopRequest(), lines.append, {STORAGE_ENV: URL})
    assert len(names) == 2
    assert lines == []  # a worker without the URL would exit 3 and be reported


def test_the_optuna_dashboard_gets_the_storage_from_the_environment_not_its_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import optuna_dashboard

    import sweep.studies
    from sweep.browse import main as browse

    served: dict = {}
    monkeypatch.setattr(sweep.studies, "make_storage", lambda url: ("storage of", url))  # no server here
    monkeypatch.setattr(
        optuna_dashboard, "run_server", lambda storage, **kw: served.update(storage=storage, **kw)
    )
    monkeypatch.setenv(STORAGE_ENV, URL)
    assert browse(["dashboard", "--results", str(tmp_path), "--port", "8123"]) == 0
    assert served == {"storage": ("storage of", URL), "host": "127.0.0.1", "port": 8123}
    out = capsys.readouterr().out
    assert (
        out
        == "optuna-dashboard on postgresql+psycopg://alice:***@db.example:5432/sweeps: open http://127.0.0.1:8123/\n"
    )
    assert "$(STORAGE)" not in Path("Makefile").read_text().split("\ndashboard:")[1].split("\n\n")[0]


@pytest.mark.parametrize("command", ["dashboard", "sweep", "tune"])
def test_a_storage_that_does_not_answer_is_one_line_without_its_password(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Without psycopg: its driver is not installed; with it (CI): nothing listens on port 1.
    Either was a traceback of 40-120 lines."""
    from sweep.browse import main as browse

    monkeypatch.setenv(STORAGE_ENV, URL.replace("db.example:5432", "127.0.0.1:1"))
    grid = tmp_path / "micro.yaml"
    grid.write_text(MICRO)
    results = ["--results", str(tmp_path / "results")]
    if command == "dashboard":
        code = browse(["dashboard", *results])
    else:
        more = ["--workers", "2"] if command == "sweep" else ["--trials", "1"]
        code = main([command, "--grid", str(grid), *results, *more])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and SECRET not in err, err
    assert err.startswith("error: Optuna storage postgresql+psycopg://alice:***@127.0.0.1:1/sweeps")


def test_a_tracking_uri_password_is_hidden_when_the_store_cannot_be_reached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    grid = tmp_path / "micro.yaml"
    grid.write_text(MICRO)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"https://alice:{SECRET}@127.0.0.1:1")
    assert main(["tables", "--grid", str(grid), "--results", str(tmp_path / "results")]) == 2
    err = capsys.readouterr().err
    assert err == "error: tracking store https://alice:***@127.0.0.1:1 is not reachable: ConnectionError\n"


def test_the_mlflow_ui_gets_its_store_from_the_environment_not_its_command_line(
    micro: dict, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import os

    from sweep.browse import main as browse

    uri = f"sqlite:///{micro['results'] / 'mlflow.db'}"
    started: list = []
    monkeypatch.setattr(os, "execv", lambda exe, argv: started.append(argv))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.delenv("MLFLOW_BACKEND_STORE_URI", raising=False)
    assert browse(["ui", "--grid", str(micro["grid"]), "--results", str(micro["results"])]) == 0
    (argv,) = started
    assert uri not in argv and argv[1:4] == ["-m", "mlflow", "ui"]
    assert os.environ["MLFLOW_BACKEND_STORE_URI"] == uri
