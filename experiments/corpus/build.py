"""Building a corpus from its recipe: fetch and read the sources, split by document, train the BPE
tokenizer, encode the token files, write the manifest last (see ``experiments.corpus``)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import experiments.corpus.backcopy as backcopy
import experiments.corpus.sources as sources
import experiments.corpus.streamed as streamed
from experiments.checksums import file_sha256, require_recorded, verify, write_checksums
from experiments.config import DataConfig, identity_dict, to_dict
from experiments.corpus.bpe import train_bpe
from experiments.corpus.encoders import Mismatch, TokenizersEncoder, document_encoder
from experiments.corpus.inputs import changed_input
from experiments.corpus.reader import (
    CORPUS_FORMAT_VERSION,
    EOS,
    MANIFEST,
    SPLITS,
    TOKENIZER_FILE,
    Corpus,
    CorpusDamaged,
    CorpusError,
    default_cache_root,
    manifest_header,
)
from experiments.corpus.repeats import DEDUP_RULE, Repeats, checked_shared, repeats_record, text_key
from experiments.corpus.sources import Source
from experiments.corpus.token_files import encode_splits


def recipe_hash(cfg: DataConfig) -> str:
    """12 hex chars identifying the corpus a recipe builds.

    Hashes the canonical JSON of ``identity_dict(cfg)``, the package pins of its sources,
    :data:`CORPUS_FORMAT_VERSION` and the interpreter's ``major.minor`` (the stdlib source's
    content depends on it).
    """
    payload = {
        "recipe": {k: v for k, v in identity_dict(cfg).items() if k not in cfg.NOT_IN_CORPUS},
        "pins": [sources.SOURCES[s.package].pin for s in cfg.specs() if s.package in sources.SOURCES],
        "format": CORPUS_FORMAT_VERSION,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    if cfg.streamed:  # only then: every package recipe keeps the corpus (and the run keys) it had
        payload["build"] = streamed.BUILD_VERSION
    if missing := sources.unavailable(s.package for s in cfg.specs() if s.package):  # a corpus without them
        payload["unavailable"] = missing
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclass
class _Doc:
    source: str
    doc_id: str
    text: str
    key: str  # sha256(f"{source}/{doc_id}"): the order for the cap and the splits


@dataclass
class _Read:
    name: str
    source: Source
    sha256: str
    archive: str | None
    docs: list[_Doc]  # every non-blank document, in key order
    seconds: float


@dataclass
class _Loaded:
    name: str
    source: Source
    sha256: str
    archive: str | None
    docs: list[_Doc]  # after the repeats and the cap, in key order
    n_available: int
    chars_available: int
    moved: bool  # the cap kept other documents than it did before repeats were dropped (rule 0)


def build_corpus(
    cfg: DataConfig, cache_root: Path | None = None, log: Callable[[str], None] = print
) -> Corpus:
    """Build the corpus for ``cfg`` into ``<cache_root>/corpus-<recipe_hash>``, or open it if it exists.

    Returns at once (no work, no log) when the directory's ``manifest.json`` exists. Otherwise builds in
    a temporary directory beside it and renames it into place, so a crash never leaves a half-written
    corpus. Builders of the same recipe take turns on a lock file, and a rival's finished corpus wins the
    rename, so concurrent callers all end with the same valid corpus. Archives are cached in
    ``<cache_root>/downloads``. ``log`` gets one short line per stage with its seconds.

    Raises:
        CorpusError: a source could not be fetched or read, yielded no documents or a duplicate doc id,
            or a domain has fewer than 3 documents (one per split).
        CorpusDamaged: the corpus was built before and a file of it changed since (a subclass).
        OSError: the cache could not be written (a full disk); its filename is the corpus folder.
    """
    cache_root = Path(cache_root) if cache_root is not None else default_cache_root()
    digest = recipe_hash(cfg)
    final = cache_root / f"corpus-{digest}"
    if (final / MANIFEST).is_file() and not before_repeats_rule(existing := open_checked(final)):
        return _unchanged_inputs(cfg, existing)
    if cache_root.exists() and not cache_root.is_dir():
        raise CorpusError(f"corpus cache {cache_root} is a file, not a folder (GATED_ATTN_CACHE names it)")
    cache_root.mkdir(parents=True, exist_ok=True)
    with _exclusive(cache_root / f".corpus-{digest}.lock"):
        stale = False
        if (final / MANIFEST).is_file():  # a rival built it while we waited, or it is of the old rule
            if not (stale := before_repeats_rule(existing := open_checked(final))):
                return _unchanged_inputs(cfg, existing)
            log(
                f"corpus {digest}: built before repeated texts were kept once (its validation may hold "
                "trained text); building it again"
            )
        for debris in cache_root.glob(f".corpus-{digest}.tmp-*"):  # of killed builds; we hold the lock
            shutil.rmtree(debris, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".corpus-{digest}.tmp-", dir=cache_root))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the published corpus is shared read-only data
        try:
            if cfg.synthetic is not None:
                backcopy.write_corpus(cfg, digest, tmp, log)
            elif cfg.streamed:
                streamed.write_corpus(cfg, digest, tmp, cache_root / "downloads", log)
            else:
                _build(cfg, digest, tmp, cache_root / "downloads", log)
            write_checksums(tmp)
            _publish(tmp, final, replace=stale)
        except OSError as err:  # the machine (a full disk, say): name the corpus and the cause
            cause = err.strerror or str(err)
            raise OSError(err.errno, f"cannot build the corpus here ({cause})", str(final)) from err
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return open_checked(final)


def _unchanged_inputs(cfg: DataConfig, corpus: Corpus) -> Corpus:
    """``corpus``, unless a local file it was built from (a ``files`` source, the tokenizer) changed since.

    Raises:
        CorpusError: naming the file; the runs of this recipe were trained on the old bytes.
    """
    record = corpus.root.parent / f".{corpus.root.name}.verified.json"
    if cfg.streamed and (changed := changed_input(cfg, corpus.manifest, record)):
        raise CorpusError(
            f"{changed} changed since corpus {corpus.root.name} was built from it; restore it, or move "
            f"{corpus.root} away to build the new bytes (the runs trained on the old ones are then "
            "no results: each run records the fingerprint of its corpus)"
        )
    return corpus


def open_checked(root: Path) -> Corpus:
    """Open a built corpus after checking its files against the checksums of its build.

    Raises:
        CorpusDamaged: a file differs from what was built (``experiments.checksums``).
        CorpusError: no readable manifest, or another format.
    """
    table = verify(root, [MANIFEST], error=CorpusDamaged)  # the manifest before it is read
    corpus = Corpus.open(root)
    files = corpus.manifest["files"]
    token_files = [files["train"], *files["val"].values(), *files["test"].values()]
    tokenizer = [f for f in (corpus.manifest["tokenizer"]["file"],) if f]
    require_recorded(root, table, token_files + tokenizer, error=CorpusDamaged)
    return corpus


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    # flock is released by the kernel when a holder dies, so a crash cannot wedge later builds.
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def before_repeats_rule(corpus: Corpus) -> bool:
    """Whether ``corpus`` (of documents, not a synthetic task) was built before repeated texts were
    kept once (``experiments.corpus.repeats``): its validation may hold texts it trains on."""
    rule = (corpus.manifest.get("repeats") or {}).get("rule", 0)
    return corpus.manifest["recipe"].get("synthetic") is None and rule < DEDUP_RULE


def _publish(tmp: Path, final: Path, replace: bool = False) -> None:
    """Rename a finished build to ``final``; if a finished corpus is already there, keep that one,
    unless ``replace`` (it is of an older rule: moved aside, then removed)."""
    if replace:
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        return
    try:
        os.replace(tmp, final)
    except OSError:
        if (final / MANIFEST).is_file():
            return  # a rival without the lock (another cache path spelling, NFS) finished first
        shutil.rmtree(final)  # a directory without a manifest is not a corpus: replace it
        os.replace(tmp, final)


def _build(cfg: DataConfig, digest: str, out: Path, downloads: Path, log: Callable[[str], None]) -> None:
    t_start = time.perf_counter()
    names = sources.available(list(cfg.sources), log)
    repeats = Repeats()  # in recipe order, each source in key order: the first copy of a text wins
    read = [_read_source(name, downloads) for name in names]
    loaded = [_keep_first(r, repeats, cfg.max_chars_per_source, log) for r in read]

    t0 = time.perf_counter()
    domains = sorted({ld.source.domain for ld in loaded})
    splits = {d: _split_domain(d, loaded, cfg) for d in domains}  # domain -> split -> docs (key order)
    n_docs = {s: sum(len(splits[d][s]) for d in domains) for s in SPLITS}
    log(f"corpus {digest}: split {n_docs['train']}/{n_docs['val']}/{n_docs['test']} docs {_secs(t0)}")

    t0 = time.perf_counter()
    train_texts = [doc.text for d in domains for doc in splits[d]["train"]]
    tokenizer = train_bpe(train_texts, cfg.vocab_size)
    tokenizer.save(str(out / TOKENIZER_FILE))
    vocab_size = tokenizer.get_vocab_size()
    eos_id = tokenizer.token_to_id(EOS)
    if eos_id != 0:  # the trainer adds special tokens first; anything else means a tokenizers change
        raise CorpusError(f"tokenizer: '{EOS}' got id {eos_id}, expected 0")
    log(f"corpus {digest}: tokenizer vocab {vocab_size} {_secs(t0)}")

    t0 = time.perf_counter()
    dtype = np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)
    files: dict[str, Any] = {"train": "train.bin", "val": {}, "test": {}}
    encoder = document_encoder(tokenizer, add_special_tokens=False, log=log)
    try:
        counts, totals, ledger = encode_splits(encoder, tokenizer, domains, splits, eos_id, dtype, out, files)
    except Mismatch as err:
        log(f"corpus {digest}: {err}; encoding with HF tokenizers instead")
        encoder = TokenizersEncoder(tokenizer, add_special_tokens=False)
        counts, totals, ledger = encode_splits(encoder, tokenizer, domains, splits, eos_id, dtype, out, files)
    train_tokens = sum(totals["train"].values())
    log(f"corpus {digest}: encoded {train_tokens:,} train tokens ({encoder.engine}) {_secs(t0)}")

    spans, start = {}, 0
    for d in domains:
        spans[d] = [start, start + totals["train"][d]]
        start += totals["train"][d]
    manifest = {
        **manifest_header(to_dict(cfg), digest),
        "build_seconds": round(time.perf_counter() - t_start, 2),
        "domains": domains,
        "dtype": dtype.name,
        "tokenizer": {"file": TOKENIZER_FILE, "vocab_size": vocab_size, "eos_id": eos_id, "eos": EOS},
        "files": files,
        "tokens": totals,
        "train_spans": spans,
        "sources": [_source_entry(ld, splits[ld.source.domain], counts) for ld in loaded],
        "repeats": repeats_record(repeats, moved=any(ld.moved for ld in loaded)),
        "shared_with_train": checked_shared(ledger),
    }
    # Written last: its presence is what marks a corpus directory as complete.
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"corpus {digest}: built in {_secs(t_start)}")


def _read_source(name: str, downloads: Path) -> _Read:
    """Fetch and read one source: its non-blank documents in key order (CRLF made LF)."""
    t0 = time.perf_counter()
    src = sources.SOURCES.get(name)
    if src is None:
        known = ", ".join(sorted(sources.SOURCES))
        raise CorpusError(f"source '{name}': not in the registry; known: {known}")
    try:
        archive = sources.fetch(name, src, downloads) if src.package else None
        digest = hashlib.sha256()
        docs, seen = [], set()
        for doc_id, text in src.extract(archive):
            # Without an archive the content is the identity: hash it before any cleaning.
            if archive is None:
                digest.update(text.encode("utf-8"))
            if doc_id in seen:
                raise CorpusError(f"source '{name}': duplicate doc id '{doc_id}'")
            seen.add(doc_id)
            text = text.replace("\r\n", "\n")
            if text.strip():  # a whitespace-only document would be a lone eos
                key = hashlib.sha256(f"{name}/{doc_id}".encode()).hexdigest()
                docs.append(_Doc(name, doc_id, text, key))
        sha = file_sha256(archive) if archive is not None else digest.hexdigest()
    except CorpusError:
        raise
    except Exception as err:  # any extractor failure becomes one line naming the source
        raise CorpusError(f"source '{name}': {type(err).__name__}: {_one_line(str(err))}") from err
    if not docs:
        raise CorpusError(f"source '{name}': yielded no non-empty documents")
    docs.sort(key=lambda doc: doc.key)
    archive_name = archive.name if archive is not None else None
    return _Read(name, src, sha, archive_name, docs, time.perf_counter() - t0)


def _keep_first(read: _Read, repeats: Repeats, max_chars: int, log: Callable[[str], None]) -> _Loaded:
    """The source's documents less the repeats of a text met before (``repeats``), then its first
    ones in key order up to ``max_chars``."""
    firsts = repeats.keep(read.name, [text_key(doc.text) for doc in read.docs])
    repeats.commit()
    first = [doc for doc, kept in zip(read.docs, firsts) if kept]
    kept = _cap(first, max_chars)
    chars = sum(len(doc.text) for doc in kept)
    if line := repeats.line(read.name):
        log(line)
    log(f"corpus: {read.name} {read.source.version}: {len(kept)}/{len(read.docs)} docs, {chars:,} chars "
        f"{read.seconds:.1f}s")  # fmt: skip
    return _Loaded(
        name=read.name,
        source=read.source,
        sha256=read.sha256,
        archive=read.archive,
        docs=kept,
        n_available=len(read.docs),
        chars_available=sum(len(doc.text) for doc in read.docs),
        moved=[d.doc_id for d in kept] != [d.doc_id for d in _cap(read.docs, max_chars)],
    )


def _cap(docs: list[_Doc], max_chars: int) -> list[_Doc]:
    """The leading documents whose total stays within ``max_chars``, but at least 3 (one per split)."""
    kept, total = [], 0
    for doc in docs:
        if len(kept) >= 3 and total + len(doc.text) > max_chars:
            break  # stop, not skip: skipping would favour short documents
        kept.append(doc)
        total += len(doc.text)
    return kept


def _split_domain(domain: str, loaded: list[_Loaded], cfg: DataConfig) -> dict[str, list[_Doc]]:
    """Deterministic document-level split of one domain: val, then test, then train in key order."""
    members = [ld for ld in loaded if ld.source.domain == domain]
    docs = sorted((doc for ld in members for doc in ld.docs), key=lambda doc: doc.key)
    n = len(docs)
    if n < 3:
        names = ", ".join(ld.name for ld in members)
        raise CorpusError(f"source '{names}': domain '{domain}' has {n} documents; need at least 3")
    n_val = max(1, round(n * cfg.val_fraction))
    # With fractions < 0.5 and n >= 3 this clamp keeps every split non-empty.
    n_test = min(max(1, round(n * cfg.test_fraction)), n - n_val - 1)
    return {"val": docs[:n_val], "test": docs[n_val : n_val + n_test], "train": docs[n_val + n_test :]}


def _source_entry(
    ld: _Loaded, domain_splits: dict[str, list[_Doc]], counts: dict[tuple[str, str], int]
) -> dict[str, Any]:
    return {
        "name": ld.name,
        "domain": ld.source.domain,
        "version": ld.source.version,
        "license": ld.source.license,
        "pin": ld.source.pin,
        "archive": ld.archive,
        "sha256": ld.sha256,
        "n_docs": len(ld.docs),
        "chars": sum(len(doc.text) for doc in ld.docs),
        "n_docs_available": ld.n_available,
        "chars_available": ld.chars_available,
        "tokens": {s: counts.get((ld.name, s), 0) for s in SPLITS},
        # In file order; a domain's file interleaves its sources by sha256(f"{source}/{doc_id}").
        "doc_ids": {s: [doc.doc_id for doc in domain_splits[s] if doc.source == ld.name] for s in SPLITS},
    }


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300] or "(no message)"


def _secs(t0: float) -> str:
    return f"{time.perf_counter() - t0:.1f}s"
