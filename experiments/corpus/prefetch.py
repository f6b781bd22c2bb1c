"""A source's documents read by a thread in batches, one batch ahead of their encoding: the
tokenizer's threads never wait on the reader (``experiments.corpus.documents`` reads them)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from pathlib import Path

from experiments.corpus.documents import Doc, SeenFiles, documents
from experiments.corpus.read_files import ReadFiles
from experiments.data_config import SourceSpec


def batches(
    spec: SourceSpec,
    downloads: Path,
    max_chars: int,
    ahead: int = 2,
    seen: SeenFiles | None = None,
    max_bytes: int | None = None,
    record: ReadFiles | None = None,
) -> Iterator[list[Doc]]:
    """The source's :func:`documents` in lists of about ``max_chars`` characters, read and parsed
    by a thread up to ``ahead`` lists in front of the caller: the next list is read while the
    caller encodes this one. Memory: ``ahead + 2`` lists at most.

    Raises:
        CorpusError: as :func:`documents`, when the list it concerns is reached.
    """
    ready: queue.Queue[list[Doc] | BaseException | None] = queue.Queue(maxsize=ahead)
    stop = threading.Event()

    def put(item: list[Doc] | BaseException | None) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            batch, size = [], 0
            for doc in documents(spec, downloads, seen, max_bytes, record):
                batch.append(doc)
                size += len(doc.text)
                if size >= max_chars:
                    if not put(batch):
                        return
                    batch, size = [], 0
            put(batch) if batch else None
            put(None)
        except BaseException as err:  # handed to the caller, who raises it as it was
            put(err)

    reader = threading.Thread(target=read, name=f"read {spec.label}", daemon=True)
    reader.start()
    try:
        while (item := ready.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:  # the caller stopped early (a cap reached) or failed: let the reader go
        stop.set()
        reader.join(timeout=10)  # it stops at its next list; a daemon if a read hangs
