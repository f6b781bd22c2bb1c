"""Checks of a source file by its layout, without ``datasets``: the bound on one document's size
(``data.max_document_bytes``), checked before a file is read where its layout allows (a document
larger than the bound would hold the reader's and the tokenizer's memory at many times its size:
a 200 MB JSON line, 1.4 GB in ``datasets`` alone), and the line a JSON-lines file fails to parse at."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import IO

import numpy as np

from experiments.corpus.reader import CorpusError

_CHUNK = 1 << 26  # 64 MiB a read: memory flat on a file of any size
JSON_LINES = (".jsonl", ".jsonl.gz", ".jsonl.zst")  # one JSON document a line


def _text(path: Path) -> IO[str]:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if path.name.endswith(".zst"):
        import io

        import zstandard

        return io.TextIOWrapper(
            zstandard.ZstdDecompressor().stream_reader(open(path, "rb")), encoding="utf-8"
        )
    return open(path, encoding="utf-8")


def first_bad_line(path: Path) -> tuple[int, str] | None:
    """(0-based line number, the parser's reason) of the first line of a JSON-lines file that is
    not JSON (blank lines are skipped, as the reader skips them), or ``None``: the slow path that
    names the line after the reader failed somewhere in a block of rows."""
    with _text(path) as fh:
        for number, line in enumerate(fh):
            if line.strip():
                try:
                    json.loads(line)
                except ValueError as err:
                    return number, str(err)
    return None


def longest_line(path: Path) -> tuple[int, int]:
    """(0-based line number, bytes without its newline) of the longest line of an uncompressed
    file, read in 64 MiB chunks at numpy's speed."""
    best, best_line, line, run = -1, 0, 0, 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            ends = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 10)
            if ends.size == 0:
                run += len(chunk)
                continue
            lengths = np.diff(ends, prepend=-1) - 1
            lengths[0] += run
            at = int(np.argmax(lengths))
            if lengths[at] > best:
                best, best_line = int(lengths[at]), line + at
            line += ends.size
            run = len(chunk) - 1 - int(ends[-1])
    if run > best:
        best, best_line = run, line
    return best_line, max(best, 0)


def has_line_over(path: Path, bound: int) -> bool:
    """Whether an uncompressed file has a line of more than ``bound`` bytes (without its newline).
    Looks for the last newline in each ``bound + 1`` bytes from the current line's start: a file of
    short lines is decided from a few pages every ``bound`` bytes, without reading it through."""
    import mmap

    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        start = 0
        while len(mm) - start > bound:
            newline = mm.rfind(b"\n", start, start + bound + 1)
            if newline < 0:
                return True
            start = newline + 1
    return False


def too_large(label: str, where: str, what: str, size: int, bound: int) -> CorpusError:
    """The one line that refuses a document over the bound."""
    return CorpusError(
        f"source '{label}': {where}: {what} is a document of {size:,} bytes, more than "
        f"data.max_document_bytes ({bound:,}); split it into documents, or raise the setting"
    )


def check_before_reading(label: str, path: Path, fmt: str, bound: int) -> None:
    """Refuse ``path`` before it is read if one of its documents is over ``bound`` bytes: a text
    file (one document) by its size, an uncompressed JSON-lines file by its longest line. Other
    files (compressed, Parquet, Arrow) are checked document by document as they are read.

    Raises:
        CorpusError: naming the file, the line and the size.
    """
    size = path.stat().st_size
    if size <= bound:
        return
    if fmt == "text" and not path.name.endswith(".gz"):
        raise too_large(label, str(path), "the file", size, bound)
    if fmt == "json" and path.name.endswith((".jsonl", ".json")):
        if not has_line_over(path, bound):
            return
        line, longest = longest_line(path)
        if longest > bound:
            raise too_large(label, str(path), f"line {line + 1}", longest, bound)
