"""Whether a built corpus's local inputs (its ``files`` sources, its pretrained tokenizer) still hold
the bytes it was built from. Their bytes decide, never their names or dates: a file touched or
renamed into the same place is the same input, one rewritten in place with its size and
modification time kept is another."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import experiments.corpus.documents as D
from experiments.checksums import file_sha256
from experiments.config import DataConfig


def file_list(paths: list[Path]) -> list[list[Any]]:
    """[path relative to the files' common folder, bytes, modification time (ns)] of each file: the
    manifest's record of a ``files`` source."""
    root = D.common_root(paths)
    return [[p.relative_to(root).as_posix(), p.stat().st_size, p.stat().st_mtime_ns] for p in paths]


def _stamps(paths: list[Path]) -> list[list[Any]]:
    # ctime moves with any write (and cannot be set back without root): with the inode it tells a
    # file verified before from one rewritten since, size and mtime kept or not.
    return [[str(p), s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino] for p in paths for s in [p.stat()]]


def changed_input(cfg: DataConfig, manifest: dict[str, Any], record: Path) -> str | None:
    """The first local input of a built corpus whose bytes are not those it was built from: a
    ``files`` source's files (their names, sizes or bytes) or the pretrained tokenizer; ``None`` if
    none changed.

    A source's files are read (hashed) unless ``record`` (a file beside the corpus, in the cache's
    writable part) says this machine hashed them with the same size, mtime, ctime and inode; a
    record that cannot be written only costs the next open another read.

    Raises:
        CorpusError: a ``files`` pattern now matches nothing (``documents.matched_files``).
    """
    try:
        verified = json.loads(record.read_text())
    except (OSError, ValueError):
        verified = {}
    entries = {entry["name"]: entry for entry in manifest["sources"]}
    changed = None
    for spec in cfg.specs():
        entry = entries.get(spec.label)
        if spec.kind != "files" or entry is None:
            continue
        paths = D.matched_files(spec)
        if [f[:2] for f in file_list(paths)] != [f[:2] for f in entry["file_list"]]:
            changed = f"source '{spec.label}': its files"
            break
        stamps, key = _stamps(paths), f"{spec.label} {entry['sha256']}"
        if verified.get(key) == stamps:
            continue
        if D.file_sha256(paths) != entry["sha256"]:
            changed = f"source '{spec.label}': its files"
            break
        verified[key] = stamps
    if changed is None and cfg.tokenizer is not None:
        path = Path(cfg.tokenizer.file).expanduser()
        if not path.is_file() or file_sha256(path) != manifest["tokenizer"].get("sha256"):
            changed = f"tokenizer {path}"
    try:
        tmp = record.with_name(f"{record.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(verified) + "\n")
        tmp.replace(record)
    except OSError:
        pass
    return changed
