"""One document, one split: a document that a corpus's sources hold more than once is kept once.

The first occurrence, in the build's reading order (the recipe's sources in order; within a
source, the order its builder reads it), keeps its place and its split; every later one is
dropped, and the build says in one line per source how many it lost to which source. The same
document therefore never stands in two splits, wherever its copies came from: a ``.jsonl``
beside its ``.gz``, the same rows as JSON lines and Parquet, overlapping shards, a document
repeated inside a file, one file under two domains. A corpus without repeats is built byte for
byte as before.

What "the same" means: the package build (``experiments.corpus.build``) compares texts after
the cleaning it applies (CRLF made LF), before its BPE is trained, which gives alike ids exactly
to alike texts. The streamed build (``experiments.corpus.streamed``) compares the ids each
document is encoded to, what training reads: two texts a pretrained tokenizer's normaliser makes
one (NFC, lower case) are one document.

Each build also keeps a :class:`Ledger` of the ids of every document it writes, by split, and
refuses to publish a corpus in which a validation or test document also stands in train; the
counts (0) are the manifest's ``shared_with_train``, which ``make data`` prints.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from experiments.corpus.reader import CorpusError

DEDUP_RULE = 1
"""The rule's version, recorded in every manifest (``"repeats"``); a corpus built without it is
built again (``experiments.corpus.build``)."""


def _key(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=16).digest(), "little")


def text_key(text: str) -> int:
    """128 bits of BLAKE2b over the text's UTF-8 bytes (lone surrogates kept): its identity."""
    return _key(text.encode("utf-8", "surrogatepass"))


def ids_keys(flat: np.ndarray, lengths: np.ndarray) -> list[int]:
    """The identity of each document of an encoded batch: 128 bits of BLAKE2b over its ids.

    Args:
        flat: ``(sum(lengths),)`` the documents' ids one after another.
        lengths: ``(n,)`` each document's count.
    """
    ids = np.ascontiguousarray(flat, dtype=np.uint32)
    ends = np.cumsum(lengths).tolist()
    starts = [0, *ends[:-1]]
    return [_key(ids[a:b].tobytes()) for a, b in zip(starts, ends)]


def firsts_only(flat: np.ndarray, lengths: np.ndarray, places: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The batch ``(flat, lengths)`` with only its documents at ``places`` (sorted indices)."""
    if len(places) == len(lengths):
        return flat, lengths
    chosen = np.zeros(len(lengths), dtype=bool)
    chosen[places] = True
    return flat[np.repeat(chosen, lengths)], lengths[chosen]


class Repeats:
    """The documents met so far in a build (by key), each with the source that held it first.

    Memory grows by about 100 bytes a distinct document (10 million documents: about 1 GB), the
    one part of a streamed build that grows with the corpus. Decisions are pending until
    :meth:`commit`; :meth:`rollback` forgets those past the document a cap stopped a source at, so
    a document decided on but never written is still kept where it comes next."""

    def __init__(self) -> None:
        self.owner: dict[int, int] = {}
        self.labels: list[str] = []
        self.dropped: dict[str, collections.Counter[str]] = {}
        self._pending: collections.deque[tuple[int, str, str | None]] = collections.deque()

    def keep(self, label: str, keys: Sequence[int]) -> list[bool]:
        """For each document of ``keys`` (read from source ``label``, in order): whether it is the
        first occurrence in the build (it is recorded as met now, pending :meth:`commit`)."""
        if label not in self.labels:
            self.labels.append(label)
        me = self.labels.index(label)
        lost = self.dropped.setdefault(label, collections.Counter())
        kept = []
        for key in keys:
            first = self.owner.get(key)
            if first is None:
                self.owner[key] = me
                self._pending.append((key, label, None))
                kept.append(True)
            else:  # a repeat, of another source's document or of this source's own
                lost[self.labels[first]] += 1
                self._pending.append((key, label, self.labels[first]))
                kept.append(False)
        return kept

    def commit(self, decisions: int | None = None) -> None:
        """The oldest ``decisions`` pending decisions (all: ``None``) stand."""
        for _ in range(len(self._pending) if decisions is None else decisions):
            self._pending.popleft()

    def rollback(self) -> None:
        """Forget every pending decision, newest first: those documents count as never met."""
        while self._pending:
            key, label, repeat_of = self._pending.pop()
            if repeat_of is None:
                del self.owner[key]
            else:
                self.dropped[label][repeat_of] -= 1

    def n_dropped(self, label: str | None = None) -> int:
        """Documents dropped as repeats: of source ``label``, or of the whole build."""
        counters = [self.dropped.get(label, collections.Counter())] if label else self.dropped.values()
        return sum(sum(c.values()) for c in counters)

    def line(self, label: str) -> str | None:
        """``corpus: <label>: N documents dropped as duplicates of ones read before from <source>``
        (with each source's share when several), or ``None`` when the source lost none."""
        lost = {src: n for src, n in sorted(self.dropped.get(label, {}).items()) if n}
        if not lost:
            return None
        whom = ", ".join(f"'{src}' ({n:,})" if len(lost) > 1 else f"'{src}'" for src, n in lost.items())
        return (
            f"corpus: {label}: {sum(lost.values()):,} document(s) dropped as duplicates of ones read "
            f"before from {whom}: each document is kept once, in one split"
        )


class Ledger:
    """The key of every document a build wrote, by split: train's as a set, validation's and
    test's per domain."""

    def __init__(self) -> None:
        self.train: set[int] = set()
        self.held: dict[str, dict[str, list[int]]] = {}

    def add(self, domain: str, splits: Sequence[str], keys: Iterable[int]) -> None:
        """Documents of ``domain`` written to ``splits`` (one each), with their ``keys``."""
        for split, key in zip(splits, keys):
            if split == "train":
                self.train.add(key)
            else:
                self.held.setdefault(domain, {}).setdefault(split, []).append(key)

    def shared(self) -> dict[str, dict[str, int]]:
        """Per domain, the validation and test documents also written to train (any domain's)."""
        return {
            domain: {
                split: sum(key in self.train for key in held.get(split, [])) for split in ("val", "test")
            }
            for domain, held in sorted(self.held.items())
        }


def repeats_record(repeats: Repeats, moved: bool) -> dict[str, Any]:
    """The manifest's ``repeats``: the rule's version, the documents each source lost to each
    source, and whether that moved the corpus (``moved``: it holds other documents than a build
    before the rule did, so runs trained before the rule are not on its bytes)."""
    dropped = {
        label: {src: n for src, n in sorted(lost.items()) if n}
        for label, lost in repeats.dropped.items()
        if sum(lost.values())
    }
    return {"rule": DEDUP_RULE, "dropped": dropped, "moved": moved}


def checked_shared(ledger: Ledger) -> dict[str, dict[str, int]]:
    """:meth:`Ledger.shared`, for the manifest.

    Raises:
        CorpusError: a validation or test document also stands in train (nothing is published).
    """
    shared = ledger.shared()
    for domain, splits in shared.items():
        for split, n in splits.items():
            if n:
                raise CorpusError(
                    f"domain '{domain}': {n:,} {split} document(s) also stand in train; nothing was "
                    "published (a fault of the build: please report it)"
                )
    return shared
