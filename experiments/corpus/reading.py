"""How the streaming build (:mod:`experiments.corpus.streamed`) reads a source: its batches
checked against the document bound, their texts cleaned, and a progress line every few seconds."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import experiments.corpus.documents as D
from experiments.config import DataConfig
from experiments.corpus.limits import too_large
from experiments.data_config import SourceSpec

_PROGRESS_EVERY_S = 5.0


def bounded(batches: Iterator[list[D.Doc]], spec: SourceSpec, cfg: DataConfig) -> Iterator[list[D.Doc]]:
    """``batches`` as they come, checked against ``data.max_document_bytes``.

    Raises:
        CorpusError: a document over the bound (one its file's layout did not show before reading).
    """
    for batch in batches:
        if over := next((doc for doc in batch if doc.nbytes > cfg.max_document_bytes), None):
            where, _, row = over.doc_id.rpartition("#")
            raise too_large(
                spec.label, where or spec.label, f"row {row}", over.nbytes, cfg.max_document_bytes
            )
        yield batch


def clean_texts(
    batches: Iterator[list[D.Doc]], spec: SourceSpec, cfg: DataConfig
) -> Iterator[tuple[list[D.Doc], list[str]]]:
    """Each batch's documents and texts, CRLF made LF, whitespace-only ones left out (a lone eos);
    :func:`bounded`."""
    for batch in bounded(batches, spec, cfg):
        texts = [doc.text.replace("\r\n", "\n") for doc in batch]
        kept = [i for i, text in enumerate(texts) if not_blank(text)]
        if kept:
            yield [batch[i] for i in kept], [texts[i] for i in kept]


def not_blank(text: str) -> bool:
    """Whether ``text`` holds anything but whitespace."""
    return bool(text) and not text.isspace()  # text.strip(), without copying the text


class Progress:
    """A line every few seconds: documents, tokens, MB/s and, where the size is known, time left."""

    def __init__(self, spec: SourceSpec, log: Callable[[str], None]) -> None:
        self.spec, self.log = spec, log
        self.start = self.last = time.perf_counter()
        self.bytes = self.tokens = self.docs = 0
        self.total = sum(p.stat().st_size for p in D.matched_files(spec)) if spec.kind == "files" else None

    def update(self, nbytes: int, tokens: int, docs: int) -> None:
        self.bytes += nbytes
        self.tokens += tokens
        self.docs += docs
        now = time.perf_counter()
        if now - self.last < _PROGRESS_EVERY_S:
            return
        self.last = now
        rate = self.bytes / (now - self.start)
        left = ""
        if self.total and rate > 0:
            left = f", about {max(0.0, (self.total - self.bytes) / rate):.0f} s left"
        self.log(
            f"corpus: {self.spec.label}: {self.docs:,} docs, {self.tokens:,} tokens, "
            f"{rate / 1e6:.1f} MB/s{left}"
        )

    def done(self, kept: int, seen: int) -> str:
        secs = time.perf_counter() - self.start
        rate = self.bytes / secs / 1e6 if secs > 0 else 0.0
        return (
            f"corpus: {self.spec.label}: {kept:,}/{seen:,} docs, {self.tokens:,} tokens, "
            f"{self.bytes / 1e6:.1f} MB in {secs:.1f}s ({rate:.1f} MB/s)"
        )
