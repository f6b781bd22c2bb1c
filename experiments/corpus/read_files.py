"""The local files a streamed build reads, each recorded as the bytes the build read.

A file's bytes are hashed when the build first opens it, and its identity (size, modification
and inode change times, inode, device) is taken then and compared whenever the build opens it
again, once its last row is read, and once more before the corpus is published. Any write moves
the inode change time (which cannot be set back without root), so a file rewritten at any point
of the build fails it in one line and nothing is published; a file that held still was read as
the bytes its recorded sha256 names. (The bytes are hashed beside the reader, not inside it:
``datasets`` opens the file itself, and Parquet is read by offsets, not front to back.)

The source's sha256 is the one ``experiments.corpus.documents.file_sha256`` computes, one digest
over each file's name (relative to the files' common folder) and bytes in order, so a later open
compares it with the files found then (``experiments.corpus.inputs``).
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

from experiments.checksums import hash_file
from experiments.corpus.reader import CorpusError

Stamp = tuple[int, int, int, int, int]


def stamp(path: Path) -> Stamp:
    """``(size, mtime_ns, ctime_ns, inode, device)`` of ``path``."""
    s = os.stat(path)
    return (s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino, s.st_dev)


class ReadFiles:
    """Every local file one build reads (shared by its BPE pass and its encoding pass, and by the
    reader threads: a lock guards it)."""

    def __init__(self) -> None:
        self.stamps: dict[Path, Stamp] = {}
        self.digests: dict[str, Any] = {}  # source label -> sha256 over its files so far, in order
        self.hashed: dict[str, list[Path]] = {}  # source label -> the files in that digest
        self.lock = threading.Lock()

    def opening(self, label: str, path: Path, root: Path) -> None:
        """Before source ``label`` reads ``path`` (one of its files under ``root``): the first
        time, its stamp and bytes are recorded; later, its stamp is checked.

        Raises:
            CorpusError: the file changed since the build first opened it.
        """
        with self.lock:
            self._check(label, path)
            done = self.hashed.setdefault(label, [])
            if path not in done:  # a source's files are met in order, so this extends its digest
                digest = self.digests.setdefault(label, hashlib.sha256())
                digest.update(f"{path.relative_to(root).as_posix()}\0".encode())
                hash_file(digest, path)
                done.append(path)
                self._check(label, path)  # not rewritten while it was hashed

    def read(self, label: str, path: Path) -> None:
        """After source ``label`` read the last row of ``path``.

        Raises:
            CorpusError: the file changed while it was read.
        """
        with self.lock:
            self._check(label, path)

    def source_sha256(self, label: str, paths: list[Path], root: Path) -> str:
        """The sha256 of source ``label``'s ``paths`` (its files, in order) as the build read them;
        a file it never opened (a cap stopped the source first) is hashed and stamped now."""
        for path in paths:
            self.opening(label, path, root)
        with self.lock:
            if self.hashed[label] != paths:  # cannot happen while sources are read in order
                raise CorpusError(f"source '{label}': its files were read out of order")
            return self.digests[label].copy().hexdigest()

    def file_list(self, paths: list[Path], root: Path) -> list[list[Any]]:
        """[path relative to ``root``, bytes, modification time (ns)] of each file, as it was read:
        the manifest's record of a ``files`` source (``experiments.corpus.inputs.file_list``)."""
        return [[p.relative_to(root).as_posix(), self.stamps[p][0], self.stamps[p][1]] for p in paths]

    def unchanged(self) -> None:
        """Check, before the corpus is published, that no file read changed since.

        Raises:
            CorpusError: naming the first file that changed.
        """
        with self.lock:
            for path in self.stamps:
                self._check(None, path)

    def _check(self, label: str | None, path: Path) -> None:
        try:
            now = stamp(path)
        except OSError as err:
            now = None
            cause = err.strerror or str(err)
        else:
            cause = "it was written"
        first = self.stamps.setdefault(path, now) if now is not None else self.stamps.get(path)
        if now is None or first != now:
            where = f"source '{label}': " if label else ""
            raise CorpusError(
                f"{where}{path} changed while the corpus was being built from it ({cause}); nothing was "
                "published: build again once the file stays as it is"
            )
