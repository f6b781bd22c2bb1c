"""Bad input outside the grid file: a corpus that cannot be built, a tracking store that does not
answer, a shared store without a shared queue. Each is one line on stderr, exit status 2, and no
run in any store. (Grid-file cases: tests/test_grid.py.)"""

from __future__ import annotations

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
