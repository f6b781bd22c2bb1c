"""Bad input outside the grid file: a corpus that cannot be built, a tracking store that does not
answer, a shared store without a shared queue. Each is one line on stderr, exit status 2, and no
run in any store. (Grid-file cases: tests/test_grid.py.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from experiments import corpus as C
from sweep.cli import main
from sweep.run.ranks import free_port
from tests.support import MICRO, ROOT


def run_cli(tmp_path: Path, grid_text: str, capsys: pytest.CaptureFixture) -> tuple[int, str, Path]:
    grid = tmp_path / "micro.yaml"
    grid.write_text(grid_text)
    results = tmp_path / "results"
    code = main(["sweep", "--grid", str(grid), "--results", str(results)])
    return code, capsys.readouterr().err.strip(), results


def test_a_corpus_source_that_cannot_be_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    def unreadable(archive: Path | None):
        raise OSError("archive truncated")

    broken = C.Source(domain="literature", version="x", license="x", extract=unreadable)
    monkeypatch.setitem(C.sources.SOURCES, "shakespeare", broken)  # a local source: no download needed
    cache = tmp_path / "cache"
    monkeypatch.setenv("GATED_ATTN_CACHE", str(cache))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    code, err, results = run_cli(tmp_path, MICRO, capsys)
    assert code == 2
    grid = tmp_path / "micro.yaml"
    assert err == f"error: {grid}: data.sources: source 'shakespeare': OSError: archive truncated"
    assert list(results.iterdir()) == []  # no store: it is created only once the corpus exists
    assert not list(cache.glob("corpus-*"))


@pytest.mark.parametrize("where", ["server", "sqlite"])
def test_an_unreachable_tracking_store(
    where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    uri = f"http://127.0.0.1:{free_port()}" if where == "server" else f"sqlite:///{tmp_path}/gone/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("GATED_ATTN_CACHE", str(ROOT / ".cache"))
    code, err, results = run_cli(tmp_path, MICRO, capsys)
    assert code == 2
    reason = "is not reachable: ConnectionError" if where == "server" else "folder"
    assert err.startswith(f"error: tracking store {uri} ") and reason in err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "gone").exists() and list(results.iterdir()) == []


def test_a_damaged_corpus_is_one_line_naming_the_file_and_trains_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from sweep.grid import load_grid

    text = MICRO.replace(
        "data: {vocab_size: 512, max_chars_per_source: 200000}",
        "data: {synthetic: {tokens: 16, triggers: 2, seq_tokens: 33, train_seqs: 200, heldout_seqs: 40}}",
    )
    (tmp_path / "micro.yaml").write_text(text)
    cache = tmp_path / "cache"
    monkeypatch.setenv("GATED_ATTN_CACHE", str(cache))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    data = load_grid(tmp_path / "micro.yaml").cells("tiny")[0].config.data
    root = C.build_corpus(data, cache, log=lambda _msg: None).root
    train = root / "train.bin"
    size = train.stat().st_size
    train.write_bytes(train.read_bytes()[: size // 2])  # cut short after it was built
    code, err, results = run_cli(tmp_path, text, capsys)
    assert code == 1  # the machine's state, not the grid
    assert err == (
        f"error: corpus {root}: train.bin is {size // 2:,} bytes, {size:,} when built; "
        f"delete the folder to rebuild it (rm -r {root})"
    )
    assert list(results.iterdir()) == []  # no store, no run: checked before anything is tracked


def test_a_store_other_machines_may_sweep_into_needs_a_queue_they_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """Two machines on one tracking server, each with its own ``results/optuna.db``, would each
    take over the other's running cells: the queue alone knows who trains what. The default
    queue with such a store is one line, exit 2, before anything is built or written."""
    from sweep.run.runner import check_one_queue
    from sweep.store_urls import TrackingError

    server = "http://tracking.example:5000"
    for local in ("sqlite:////data/mlflow.db", (tmp_path / "mlruns").as_uri()):
        check_one_queue(local, tmp_path)  # a file this machine holds: its own queue is enough
    for shared in (server, "postgresql+psycopg://u:pw@db/mlflow", "databricks"):
        with pytest.raises(TrackingError, match="must share its queue"):
            check_one_queue(shared, tmp_path)

    grid, results = tmp_path / "micro.yaml", tmp_path / "results"
    grid.write_text(MICRO)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server)
    monkeypatch.setattr("sweep.run.runner.check_reachable", lambda uri: None)  # as if it answered
    monkeypatch.setenv("GATED_ATTN_CACHE", str(tmp_path / "cache"))
    assert main(["sweep", "--grid", str(grid), "--results", str(results)]) == 2
    err = capsys.readouterr().err
    queue = f"sqlite:///{(results / 'optuna.db').resolve()}"
    assert err == (
        f"error: tracking store {server} may take sweeps from other machines, and every sweep into one "
        "store must share its queue: give STORAGE=<a database they all reach> (docs/cluster.md), or "
        f"STORAGE={queue} if this machine alone sweeps into it\n"
    )
    assert list(results.iterdir()) == [] and not (tmp_path / "cache").exists()


#: Files a grid path may name by mistake (a symlink to a password file, say), each with a secret
#: on its first line that a message could echo: YAML reads ``!...`` as a tag, ``*...`` as an alias.
NOT_GRIDS = {
    "passwd": "root:x:0:0:root:/root:/bin/bash\nsecret-user:x:1000:1000::/home/s3cr3t:/bin/sh\n",
    "tag": "!s3cr3t-Passw0rd\n",
    "alias": "*s3cr3t-Passw0rd\n",
    "mapping": "password: s3cr3t-Passw0rd\ntoken: abc\n",
    "escape": 'token: "s3cr3t\\qPassw0rd"\n',
    "ini": "[default]\naws_secret_access_key = s3cr3t-Passw0rd\n",
}


@pytest.mark.parametrize("case", NOT_GRIDS)
def test_a_grid_path_that_names_another_file_is_one_line_quoting_none_of_it(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    secret = tmp_path / "secret"
    secret.write_text(NOT_GRIDS[case])
    grid = tmp_path / "grid.yaml"
    grid.symlink_to(secret)
    assert main(["params", "--grid", str(grid)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {grid}: ") and err.count("\n") == 1
    said = err.removeprefix(f"error: {grid}: ")
    assert {w for w in re.findall(r"[A-Za-z0-9]{4,}", NOT_GRIDS[case]) if w in said} == set(), said


def test_an_inherited_path_that_names_another_file_quotes_none_of_it(tmp_path: Path) -> None:
    from sweep.grid import load_grid
    from sweep.gridfile import GridError

    (tmp_path / "secret").write_text(NOT_GRIDS["tag"])
    (tmp_path / "grid.yaml").write_text("inherit: secret\nname: g\nrows: [{id: a}]\n")
    with pytest.raises(GridError) as err:
        load_grid(tmp_path / "grid.yaml")
    assert str(
        err.value
    ) == f"{tmp_path / 'secret'}: is not a grid: its top level holds none of a grid's keys " + (
        "(name, base, scales, rows)"
    )


def test_a_grid_still_names_its_own_unknown_key(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A file holding a grid's key is a grid: its mistakes are named, as before."""
    grid = tmp_path / "grid.yaml"
    grid.write_text(MICRO + "colour: red\n")
    assert main(["params", "--grid", str(grid)]) == 2
    assert "colour: unknown key" in capsys.readouterr().err


def test_log_every_beyond_max_steps_is_clamped_with_one_line_and_the_loss_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """``log_every: 100`` with ``max_steps: 8`` finished a run with no ``train/loss`` point and no
    word: Lightning logs every N-th step only. The researcher who shrank ``max_steps`` for a quick
    run expects a loss curve, so the config clamps it (no shipped cell's run key moves: none has
    ``log_every`` above ``max_steps``) and the sweep says so once."""
    from experiments.config import TrainConfig
    from tests.support import histories, use_repo_cache

    assert TrainConfig(max_steps=40, warmup_steps=4, log_every=100).log_every == 40
    assert TrainConfig(max_steps=40, warmup_steps=4, log_every=10).log_every == 10
    use_repo_cache(monkeypatch)
    grid = tmp_path / "micro.yaml"
    grid.write_text(MICRO.replace("max_lr: 2e-3}", "max_lr: 2e-3, log_every: 100}"))
    results = tmp_path / "results"
    assert main(["sweep", "--grid", str(grid), "--results", str(results), "--rows", "baseline"]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "train.log_every" in line]
    assert notes == [
        f"note: {grid}: train.log_every 100 is more than max_steps 8 (scale 'tiny', rows baseline): "
        "the training loss is logged every 8 steps instead"
    ]
    assert [step for step, _ in histories(results)["train/loss"]] == [7]  # the last step's, 0-based


#: Each bad number or count of the command lines the Makefile calls, and the start of its one line.
BAD_NUMBERS = {
    "seeds 0": (["sweep", "--seeds", "0"], "error: --seeds must be 1 to 1000, got 0"),
    "seeds x": (
        ["tables", "--seeds", "x"],
        "error: python -m sweep.cli tables: argument --seeds: invalid int",
    ),
    "workers 0": (
        ["sweep", "--workers", "0"],
        "error: python -m sweep.cli sweep: argument --workers: must be auto or",
    ),
    "workers x": (
        ["sweep", "--workers", "four"],
        "error: python -m sweep.cli sweep: argument --workers: must be auto",
    ),
    "workers huge": (
        ["sweep", "--workers", "100000"],
        "error: python -m sweep.cli sweep: argument --workers: must",
    ),
    "cells per gpu": (
        ["sweep", "--cells-per-gpu", "0"],
        "error: python -m sweep.cli sweep: argument --cells-per-gpu",
    ),
    "trials": (
        ["tune", "--trials", "-1"],
        "error: python -m sweep.cli tune: argument --trials: must be a whole",
    ),
    "lr range nan": (
        ["tune", "--lr-range", "nan,1e-2"],
        "error: --lr-range: expected finite positive numbers",
    ),
    "lr range inf": (
        ["tune", "--lr-range", "1e-4,inf"],
        "error: --lr-range: expected finite positive numbers",
    ),
    "lr range order": (["tune", "--lr-range", "1e-2,1e-4"], "error: --lr-range: expected lo,hi with lo < hi"),
    "ladder": (["stability", "--ladder", "1e-3,-1"], "error: --ladder: expected finite positive numbers"),
    "rows": (["sweep", "--rows", ","], "error: --rows names no row id"),
    "yarn": (
        ["export", "--runs", "a", "--yarn", "inf"],
        "error: python -m sweep.cli export: argument --yarn: YARN: the factor must be a finite number >= 1,",
    ),
}


def _started(*args: object, **kwargs: object) -> None:
    raise AssertionError("the bad value got past its refusal: the command started")


@pytest.fixture
def nothing_starts(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A refusal under test must come before anything runs. Should it regress, the command fails
    here at once instead of training in this process or starting workers: a ``--workers 100000``
    that once got through started about a hundred before it was killed."""
    monkeypatch.setattr(subprocess, "Popen", _started)  # no process of any kind
    monkeypatch.setattr("sweep.cli._main", _started)  # past the parse and the number checks
    monkeypatch.setattr("sweep.run.driver.start_processes", _started)
    monkeypatch.setattr("sweep.browse._browse", _started)
    monkeypatch.setattr("tools.corpus_bench._bench", _started)
    return monkeypatch


@pytest.mark.parametrize("case", BAD_NUMBERS)
def test_a_bad_number_on_the_command_line_is_one_line_and_writes_nothing(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture, nothing_starts: pytest.MonkeyPatch
) -> None:
    argv, said = BAD_NUMBERS[case]
    results = tmp_path / "results"
    try:
        code = main([*argv, "--results", str(results)])
    except SystemExit as stop:  # argparse's refusal (cli_parser.OneLineParser)
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(said) and err.count("\n") == 1, err
    assert not results.exists()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["ui", "--port", "0"],
            "error: python -m sweep.browse ui: argument --port: must be a whole number from 1",
        ),
        (["dashboard", "--port", "65536"], "error: python -m sweep.browse dashboard: argument --port: must"),
        (
            ["compare", "--runs", "a,b", "--bogus"],
            "error: python -m sweep.browse compare: does not take --bogus",
        ),
    ],
)
def test_a_bad_browse_option_is_one_line(
    argv: list[str], said: str, capsys: pytest.CaptureFixture, nothing_starts: pytest.MonkeyPatch
) -> None:
    from sweep.browse import main as browse

    with pytest.raises(SystemExit) as stop:
        browse(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(said) and err.count("\n") == 1


def test_a_dashboard_port_in_use_is_one_line_before_the_storage_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from sweep.browse import main as browse

    monkeypatch.setattr("optuna_dashboard.run_server", _started)  # should the check regress: no server

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert browse(["dashboard", "--port", str(port), "--results", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: --port {port}: 127.0.0.1:{port} is in use; give another port\n"
    assert list(tmp_path.iterdir()) == []  # no optuna.db made


#: Files ``make corpus-bench JSONL=...`` cannot bench, and the end of its one line: each was a child's
#: traceback after the driver had written and trained.
NOT_JSONL = {
    "parquet": (b"PAR1\x15\x04\x15", 'is a Parquet file; the bench reads JSON lines, {"text": ...} a line'),
    "no text": (b'{"body": "a"}\n', 'line 1 is not a JSON object with a "text" string'),
    "empty": (b"", "holds no line: nothing to bench"),
    "blank line": (
        b'{"text": "a"}\n\n{"text": "b"}\n',
        "line 2 is blank (the bench reads a JSON object a line)",
    ),
    "not json": (b'{"text": "a"}\ntext\n', "line 2 is not JSON"),
    "latin-1": ('{"text": "caf\xe9"}\n'.encode("latin-1"), "is not UTF-8 text"),
}


@pytest.mark.parametrize("case", NOT_JSONL)
def test_corpus_bench_refuses_a_file_it_cannot_bench_in_one_line(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture, nothing_starts: pytest.MonkeyPatch
) -> None:
    from tools.corpus_bench import main as bench

    content, said = NOT_JSONL[case]
    path = tmp_path / "data.jsonl"
    path.write_bytes(content)
    work = tmp_path / "work"
    work.mkdir()
    with pytest.raises(SystemExit) as stop:
        bench(["--file", str(path), "--dir", str(work)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1
    assert err.startswith(f"error: python -m tools.corpus_bench: argument --file: {path}: {said}"), err
    assert list(work.iterdir()) == []


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--mb", "0"], "argument --mb: must be a whole number of at least 1, got '0'"),
        (["--rounds", "x"], "argument --rounds: must be a whole number of at least 1, got 'x'"),
        (["--kill-after", "nan"], "argument --kill-after: must be a finite number of seconds above 0"),
        (["--dir", "/nowhere/at/all"], "argument --dir: /nowhere/at/all: no such folder"),
        (["--mb", str(10**12)], f"--mb {10**12}: the work folder has"),
        (["--against", "/"], "--against /: not a checkout of this project"),
    ],
)
def test_corpus_bench_refuses_a_bad_option_in_one_line(
    argv: list[str], said: str, capsys: pytest.CaptureFixture, nothing_starts: pytest.MonkeyPatch
) -> None:
    from tools.corpus_bench import main as bench

    with pytest.raises(SystemExit) as stop:
        bench(argv)
    err = capsys.readouterr().err
    assert (
        stop.value.code == 2
        and err.startswith(f"error: python -m tools.corpus_bench: {said}")
        and err.count("\n") == 1
    )


@pytest.mark.parametrize(
    ("module", "argv", "said"),
    [
        (
            "tools.throughput.__main__",
            ["--rounds", "0"],
            "python -m tools.throughput: argument --rounds: must be",
        ),
        (
            "tools.throughput.__main__",
            ["--threads", "0"],
            "python -m tools.throughput: argument --threads: must",
        ),
        (
            "tools.gpu_check",
            ["--dry-run", "--budget", "0"],
            "python -m tools.gpu_check: argument --budget: must",
        ),
        (
            "sweep.report.init_table",
            ["--results", "Makefile"],
            "python -m sweep.report.init_table: --results",
        ),
        ("sweep.report.headline", ["--force"], "python -m sweep.report.headline: does not take --force"),
    ],
)
def test_the_other_entry_points_the_makefile_calls_refuse_a_bad_option_in_one_line(
    module: str, argv: list[str], said: str, capsys: pytest.CaptureFixture, nothing_starts: pytest.MonkeyPatch
) -> None:
    """Each ran on: 0 throughput rounds printed an empty table, --threads 0 was torch's traceback,
    init_table made any folder it was given, headline ignored its arguments and wrote the figure."""
    import importlib

    entry = importlib.import_module(module)
    for after_the_parse in (
        "load_grid",
        "quiet_lightning",
        "init_rows",
        "write_headline",
    ):  # what each runs next
        if hasattr(entry, after_the_parse):
            nothing_starts.setattr(entry, after_the_parse, _started)
    with pytest.raises(SystemExit) as stop:
        entry.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(f"error: {said}") and err.count("\n") == 1, err
