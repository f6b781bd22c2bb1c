"""A password in a storage URL reaches no output, file, artifact or command line: printed lines
and the tables' command show ``***``, and workers get the URL through their environment."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sweep.cli import main
from sweep.run.interrupt import StopRequest
from sweep.run.queue import start_processes
from sweep.store_urls import STORAGE_ENV, hide_password
from tests.conftest import MICRO

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
    ],
)
def test_hide_password_replaces_only_the_password(text: str, shown: str) -> None:
    assert hide_password(text) == shown


def test_a_storage_password_reaches_no_worker_command_line_table_or_printed_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    import sweep.run.queue as queue

    seen: dict = {}

    def queued(grid, cells, results, workers, url, worker_args, *rest, **kwargs):  # no server here
        seen.update(url=url, worker_args=worker_args)
        return []

    monkeypatch.setattr(queue, "run_queued_sweep", queued)
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
