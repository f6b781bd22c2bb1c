"""Corpus sources beyond the packages: local files (JSON lines, Parquet, text), a hub data set
through a patched ``datasets.load_dataset``, a pretrained tokenizer; offline, on files this test
writes. Document boundaries are checked against a direct tokenisation of each document."""

from __future__ import annotations

import json
import random
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from experiments import corpus as C
from experiments.config import ConfigError, DataConfig, from_dict
from experiments.corpus.streamed import split_of
from experiments.data import RandomWindows, disjoint_windows
from sweep.cli import main

WORDS = "the of and to a in that is was he for it with as his on be at by this had not are but from".split()


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS + ["naïve", "漢字", "{x}"]) for _ in range(rng.randint(20, 90))) + "\n"


def _write(folder: Path) -> dict[str, list[str]]:
    """A JSONL, a Parquet and three text files; returns each format's documents in file order."""
    rng = random.Random(7)
    folder.mkdir(parents=True, exist_ok=True)
    docs = {"jsonl": [_text(rng) for _ in range(60)], "parquet": [_text(rng) for _ in range(60)]}
    docs["text"] = [_text(rng) for _ in range(30)]
    with open(folder / "web.jsonl", "w", encoding="utf-8") as fh:
        for i, text in enumerate(docs["jsonl"]):
            fh.write(json.dumps({"id": i, "body": text}, ensure_ascii=False) + "\n")
    pq.write_table(pa.table({"body": docs["parquet"]}), folder / "web.parquet")
    for i, text in enumerate(docs["text"]):
        (folder / f"note{i:02d}.txt").write_text(text, encoding="utf-8")
    return docs


def _cfg(folder: Path, **extra) -> DataConfig:
    sources = [
        {"files": str(folder / "web.jsonl"), "domain": "web", "text_field": "body"},
        {"files": [str(folder / "*.parquet")], "domain": "web", "text_field": "body"},
        {"files": str(folder / "note*.txt"), "domain": "notes"},
    ]
    return from_dict(DataConfig, {"vocab_size": 300, "val_fraction": 0.2, "test_fraction": 0.2,
                                  "sources": sources, **extra})  # fmt: skip


def _split_docs(tokens: np.ndarray, eos: int) -> list[list[int]]:
    ends = np.flatnonzero(tokens == eos)
    starts = np.concatenate([[0], ends[:-1] + 1])
    assert ends[-1] == len(tokens) - 1  # every document ends with the separator
    return [tokens[s:e].tolist() for s, e in zip(starts, ends)]


def test_files_of_three_formats_build_with_documents_whole_and_split_by_their_hash(tmp_path: Path) -> None:
    docs = _write(tmp_path / "data")
    cfg = _cfg(tmp_path / "data")
    corpus = C.build_corpus(cfg, tmp_path / "cache", log=lambda _m: None)
    assert corpus.domains == ["notes", "web"]
    tok, eos = corpus.tokenizer(), corpus.eos_id
    labels = [s.label for s in cfg.specs()]
    expect: dict[tuple[str, str], list[list[int]]] = {}
    order = [("jsonl", labels[0], "web", "web.jsonl#"), ("parquet", labels[1], "web", "web.parquet#")]
    order += [("text", labels[2], "notes", None)]
    for fmt, label, domain, prefix in order:
        for i, text in enumerate(docs[fmt]):
            doc_id = f"{prefix}{i}" if prefix else f"note{i:02d}.txt#0"
            split = split_of(label, doc_id, cfg)
            expect.setdefault((split, domain), []).append(tok.encode(text).ids)
    for domain in corpus.domains:
        for split in ("val", "test"):
            assert _split_docs(np.asarray(corpus.tokens(split, domain)), eos) == expect[(split, domain)]
        start, end = corpus.manifest["train_spans"][domain]
        assert _split_docs(np.asarray(corpus.tokens("train")[start:end]), eos) == expect[("train", domain)]
    entries = corpus.manifest["sources"]
    assert [e["n_docs"]["train"] + e["n_docs"]["val"] + e["n_docs"]["test"] for e in entries] == [60, 60, 30]
    assert [len(e["file_list"]) for e in entries] == [1, 1, 30]
    assert all(len(e["sha256"]) == 64 for e in entries)
    record = corpus.provenance()
    assert record["sources"][0]["file_list"][0][0] == "web.jsonl"
    assert record["sources"][2]["root"] == str(tmp_path / "data")


def test_the_same_recipe_gives_the_same_bytes(tmp_path: Path) -> None:
    _write(tmp_path / "data")
    cfg = _cfg(tmp_path / "data")
    a = C.build_corpus(cfg, tmp_path / "a", log=lambda _m: None)
    b = C.build_corpus(cfg, tmp_path / "b", log=lambda _m: None)
    for rel in ("train.bin", "val/web.bin", "test/notes.bin", "tokenizer.json"):
        assert (a.root / rel).read_bytes() == (b.root / rel).read_bytes(), rel


def test_a_changed_file_is_refused_not_silently_rebuilt(tmp_path: Path) -> None:
    _write(tmp_path / "data")
    cfg = _cfg(tmp_path / "data")
    C.build_corpus(cfg, tmp_path / "cache", log=lambda _m: None)
    with open(tmp_path / "data" / "web.jsonl", "a") as fh:
        fh.write(json.dumps({"body": "one more document"}) + "\n")
    with pytest.raises(C.CorpusError, match=r"source 'files:.*web.jsonl': its files changed since corpus"):
        C.build_corpus(cfg, tmp_path / "cache", log=lambda _m: None)


def test_a_plain_package_name_and_its_mapping_are_one_recipe_with_the_old_build() -> None:
    plain = DataConfig(sources=("stdlib",))
    mapped = from_dict(DataConfig, {"sources": [{"package": "stdlib"}]})
    assert plain == mapped and not plain.streamed
    assert C.recipe_hash(plain) == C.recipe_hash(mapped)
    capped = from_dict(DataConfig, {"sources": [{"package": "stdlib", "max_tokens": 1000}]})
    assert capped.streamed and C.recipe_hash(capped) != C.recipe_hash(plain)


def _bpe_with_eos(texts: list[str], path: Path, eos: str) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", eos], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
    return tok


def test_a_pretrained_tokenizer_is_used_as_is_with_its_own_end_of_document(tmp_path: Path) -> None:
    docs = _write(tmp_path / "data")
    pretrained = _bpe_with_eos(docs["jsonl"], tmp_path / "tok.json", "</s>")
    cfg = _cfg(tmp_path / "data", tokenizer={"file": str(tmp_path / "tok.json")})
    corpus = C.build_corpus(cfg, tmp_path / "cache", log=lambda _m: None)
    assert corpus.eos_id == pretrained.token_to_id("</s>") == 1
    assert corpus.vocab_size == pretrained.get_vocab_size()
    assert corpus.manifest["tokenizer"]["pretrained"] == str((tmp_path / "tok.json").resolve())
    first = [
        d
        for i, d in enumerate(docs["text"])
        if split_of(cfg.specs()[2].label, f"note{i:02d}.txt#0", cfg) == "val"
    ]
    got = _split_docs(np.asarray(corpus.tokens("val", "notes")), corpus.eos_id)
    assert got == [pretrained.encode(t).ids for t in first]
    assert corpus.tokens("train").dtype == np.uint16


class FakeHub:
    """``datasets.load_dataset`` for one hub data set; anything else goes to the real one."""

    def __init__(self, rows: list[dict], cached: bool) -> None:
        self.rows, self.cached, self.calls = rows, cached, []
        self.real = datasets.load_dataset

    def __call__(self, path, name=None, **kw):
        if path != "org/web-sample":
            return self.real(path, name, **kw)
        self.calls.append((name, kw.get("split"), kw.get("revision"), kw.get("streaming")))
        if not self.cached:
            raise ConnectionError("Couldn't reach 'org/web-sample' on the Hub (LocalEntryNotFoundError)")
        # What the offline config/split path really returns: a memory-mapped Dataset, or a stream.
        rows = datasets.Dataset.from_list(self.rows)
        return rows.to_iterable_dataset() if kw.get("streaming") else rows


HUB = {"hub": "org/web-sample", "config": "sample-1", "revision": "0123abcd", "domain": "web"}


def test_a_hub_source_is_read_from_the_cache_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(3)
    fake = FakeHub([{"text": _text(rng)} for _ in range(80)], cached=True)
    monkeypatch.setattr(datasets, "load_dataset", fake)
    cfg = from_dict(DataConfig, {"vocab_size": 300, "val_fraction": 0.2, "test_fraction": 0.2,
                                 "sources": [{**HUB, "max_tokens": 2000}]})  # fmt: skip
    corpus = C.build_corpus(cfg, tmp_path / "cache", log=lambda _m: None)
    assert fake.calls[0] == ("sample-1", "train", "0123abcd", False)  # the cache, not a stream
    entry = corpus.manifest["sources"][0]
    assert entry["revision"] == "0123abcd" and entry["kind"] == "hub"
    assert 1900 <= sum(entry["tokens"].values()) <= 2000  # stopped at max_tokens, whole documents
    assert sum(entry["n_docs"].values()) < 80


def _grid(tmp_path: Path, sources: list, model_vocab: int = 384, data_extra: str = "") -> Path:
    grid = tmp_path / "own.yaml"
    grid.write_text(f"""\
name: own
title: "Own"
base:
  model: {{vocab_size: {model_vocab}, d_model: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, head_dim: 8,
          ffn_dim: 64, max_seq_len: 32}}
  train: {{max_steps: 4, batch_size: 4, seq_len: 32, warmup_steps: 1, val_every: 4, val_tokens: 256}}
  data: {{vocab_size: 300, val_fraction: 0.2, test_fraction: 0.2, sources: {json.dumps(sources)}{data_extra}}}
scales: {{tiny: {{}}}}
rows:
  - {{id: baseline, label: "Baseline"}}
""")
    return grid


def _sweep(grid: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> tuple[int, str, Path]:
    monkeypatch.setenv("GATED_ATTN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    results = tmp_path / "results"
    code = main(["sweep", "--grid", str(grid), "--results", str(results)])
    return code, capsys.readouterr().err.strip(), results


def test_a_hub_source_not_in_the_cache_is_one_line_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(datasets, "load_dataset", FakeHub([], cached=False))
    grid = _grid(tmp_path, [HUB])
    assert main(["params", "--grid", str(grid)]) == 0  # validating the grid stays offline
    capsys.readouterr()
    code, err, results = _sweep(grid, tmp_path, monkeypatch, capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert "org/web-sample" in err and "not in the local Hugging Face cache" in err
    assert f"make data GRID={grid} SCALE=tiny DOWNLOAD=1" in err and "files:" in err
    assert list(results.iterdir()) == []  # no store, no run
    assert not list((tmp_path / "cache").glob("corpus-*"))


def _bad_jsonl(folder: Path, lines: list[bytes]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "bad.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.mark.parametrize(
    "case",
    ["no match", "missing field", "null", "not utf-8", "unknown ending", "vocabulary"],
)
def test_bad_sources_are_one_line_and_exit_2(
    case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    good = [json.dumps({"text": f"document {i} " * 20}).encode() for i in range(40)]
    folder = tmp_path / "data"
    spec = {"files": str(folder / "bad.jsonl"), "domain": "web"}
    model_vocab, extra = 384, ""
    if case == "no match":
        spec["files"] = str(folder / "none-*.jsonl")
        want = f"files: '{folder}/none-*.jsonl' matches no file"
    elif case == "missing field":
        _bad_jsonl(folder, good)
        spec["text_field"] = "body"
        want = "bad.jsonl: row 0: no key 'body' (keys: text)"
    elif case == "null":
        _bad_jsonl(folder, [*good[:5], b'{"text": null}', *good[5:]])
        want = "bad.jsonl: row 5: text is null, not text"
    elif case == "not utf-8":
        _bad_jsonl(folder, [*good[:3], b'{"text": "caf\xe9"}', *good[3:]])
        want = "bad.jsonl: not UTF-8 text at or after row"
    elif case == "unknown ending":
        folder.mkdir()
        (folder / "bad.jsonl.bz3").write_text("x")
        spec["files"] = str(folder / "bad.jsonl.bz3")
        want = "cannot tell the format"
    else:
        _bad_jsonl(folder, good)
        _bpe_with_eos([json.loads(g)["text"] for g in good], tmp_path / "tok.json", "<|endoftext|>")
        model_vocab, extra = 64, f", tokenizer: {{file: {tmp_path / 'tok.json'}}}"
        want = "row 'baseline': model.vocab_size: 64 cannot hold the"
    grid = _grid(tmp_path, [spec], model_vocab, extra)
    code, err, results = _sweep(grid, tmp_path, monkeypatch, capsys)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and want in err, err
    assert err.startswith("error: ")
    if case != "vocabulary":
        assert not (results / "mlflow.db").exists()


def test_disjoint_windows_read_no_token_twice_and_refuse_a_budget_they_cannot_hold() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    ds = RandomWindows(tokens, seq_len=9, n_samples=60, seed=3, disjoint=True)
    starts = sorted(int(s) for s in ds.starts)
    assert len(set(starts)) == 60 and all(s % 10 == 0 for s in starts)  # windows of 10, no overlap
    seen = np.concatenate([ds[i].numpy() for i in range(len(ds))])
    assert len(seen) == len(set(seen.tolist())) == 600
    again = RandomWindows(tokens, seq_len=9, n_samples=60, seed=3, disjoint=True)
    assert list(again.starts) == list(ds.starts)  # fixed by the seed: exact resume
    assert disjoint_windows(1000, 9) == 100
    with pytest.raises(ValueError, match="101 windows asked, 100 disjoint ones"):
        RandomWindows(tokens, seq_len=9, n_samples=101, seed=3, disjoint=True)


def test_a_budget_that_would_read_a_token_twice_is_refused_before_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    _write(tmp_path / "data")
    spec = {"files": str(tmp_path / "data" / "web.jsonl"), "domain": "web", "text_field": "body"}
    grid = _grid(tmp_path, [spec], data_extra=", train_windows: disjoint")
    grid.write_text(grid.read_text().replace("max_steps: 4,", "max_steps: 400,"))
    code, err, _ = _sweep(grid, tmp_path, monkeypatch, capsys)
    assert code == 2 and len(err.splitlines()) == 1
    assert "row 'baseline': train.max_steps: 400 steps of 4 windows read 1,600 disjoint windows of 33" in err


def test_a_hub_source_with_data_files_reads_exactly_its_revision_from_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub

    # As in a real Hugging Face cache: the snapshot's files are links into blobs/ named by hash.
    snapshot = tmp_path / "snapshots" / "0123abcd"
    (snapshot / "sample").mkdir(parents=True)
    (tmp_path / "blobs").mkdir()
    rng = random.Random(5)
    texts = [_text(rng) for _ in range(50)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "blobs" / "9f86d081884c7d65")
    (snapshot / "sample" / "000.parquet").symlink_to("../../../blobs/9f86d081884c7d65")
    calls = []

    def snapshot_download(repo_id, repo_type, revision, allow_patterns, local_files_only):
        calls.append((repo_id, repo_type, revision, allow_patterns, local_files_only))
        if revision != "0123abcd":
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    spec = {**HUB, "data_files": "sample/*.parquet"}
    cfg = from_dict(
        DataConfig, {"vocab_size": 300, "val_fraction": 0.2, "test_fraction": 0.2, "sources": [spec]}
    )
    corpus = C.build_corpus(cfg, tmp_path / "cache", log=lambda _m: None)
    assert calls[0] == ("org/web-sample", "dataset", "0123abcd", ["sample/*.parquet"], True)
    entry = corpus.manifest["sources"][0]
    assert entry["name"] == "hub:org/web-sample:sample/*.parquet" and sum(entry["n_docs"].values()) == 50
    assert entry["file_list"][0][0] == "000.parquet" and entry["revision"] == "0123abcd"
    other = from_dict(DataConfig, {"sources": [{**spec, "revision": "ffff"}]})
    with pytest.raises(C.CorpusError, match="revision ffff.* is not in the local Hugging Face cache"):
        C.build_corpus(other, tmp_path / "cache", log=lambda _m: None)


def test_moving_the_checkout_keeps_the_corpus_of_relative_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write(tmp_path / "a" / "data")
    spec = {"files": "data/*.parquet", "domain": "web", "text_field": "body"}
    cfg = from_dict(
        DataConfig, {"vocab_size": 300, "val_fraction": 0.2, "test_fraction": 0.2, "sources": [spec]}
    )
    monkeypatch.chdir(tmp_path / "a")
    first = C.build_corpus(cfg, tmp_path / "cache", log=lambda _m: None)
    (tmp_path / "a").rename(tmp_path / "b")  # mv keeps the files' modification times
    monkeypatch.chdir(tmp_path / "b")
    again = C.build_corpus(cfg, tmp_path / "cache", log=lambda _m: None)
    assert again.root == first.root and again.manifest["sources"][0]["file_list"][0][0] == "web.parquet"


def test_a_package_that_cannot_be_read_in_the_streaming_build_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unreadable(archive):
        raise OSError("archive truncated")
        yield  # a generator, as the real extractors are

    monkeypatch.setitem(C.sources.SOURCES, "stdlib", C.Source("code", "x", "x", unreadable))
    cfg = from_dict(DataConfig, {"sources": [{"package": "stdlib", "max_tokens": 1000}]})
    with pytest.raises(C.CorpusError, match="^source 'stdlib': OSError: archive truncated$"):
        C.build_corpus(cfg, tmp_path / "cache", log=lambda _m: None)


def test_disjoint_windows_are_refused_for_a_synthetic_task() -> None:
    with pytest.raises(ConfigError, match="train_windows: a synthetic task's windows start at its sequences"):
        from_dict(DataConfig, {"synthetic": {}, "train_windows": "disjoint"})
