"""The token files of a package recipe (``experiments.corpus.build``): each split of each domain
encoded in batches, each document followed by the end-of-document id."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from experiments.corpus.encoders import DocumentEncoder, SampleCheck, TokenizersEncoder, pipelined
from experiments.corpus.reader import SPLITS
from experiments.corpus.repeats import Ledger, ids_keys

_BATCH_CHARS = 2_000_000  # bounds the text and the ids held at once


def encode_splits(
    encoder: DocumentEncoder,
    tokenizer: Tokenizer,
    domains: list[str],
    splits: dict[str, dict[str, list[Any]]],
    eos_id: int,
    dtype: np.dtype,
    out: Path,
    files: dict[str, Any],
) -> tuple[dict[tuple[str, str], int], dict[str, dict[str, int]], Ledger]:
    """Write ``train.bin`` (the domains in order) and ``<split>/<domain>.bin``; return the tokens per
    (source, split) and per split and domain, and the :class:`~experiments.corpus.repeats.Ledger`
    of the documents written.

    Raises:
        Mismatch: tiktoken and ``tokenizers`` differ on a sampled document (nothing is kept).
    """
    check = SampleCheck(encoder, TokenizersEncoder(tokenizer, add_special_tokens=False))
    counts: dict[tuple[str, str], int] = {}  # (source, split) -> tokens incl. eos
    totals: dict[str, dict[str, int]] = {s: {} for s in SPLITS}  # split -> domain -> tokens
    ledger = Ledger()
    with open(out / "train.bin", "wb") as fh:
        for d in domains:
            totals["train"][d] = _encode_docs(
                check, splits[d]["train"], (d, "train"), eos_id, dtype, fh, counts, ledger
            )
    for split in ("val", "test"):
        (out / split).mkdir(exist_ok=True)
        for d in domains:
            files[split][d] = f"{split}/{d}.bin"
            with open(out / files[split][d], "wb") as fh:
                totals[split][d] = _encode_docs(
                    check, splits[d][split], (d, split), eos_id, dtype, fh, counts, ledger
                )
    return counts, totals, ledger


def _encode_docs(
    check: SampleCheck,
    docs: list[Any],
    where: tuple[str, str],
    eos_id: int,
    dtype: np.dtype,
    fh: Any,
    counts: dict[tuple[str, str], int],
    ledger: Ledger,
) -> int:
    """Append each document's ids and an eos to ``fh``, count them per (source, split) and enter them
    in ``ledger`` under ``where`` (domain, split); return the total."""
    domain, split = where
    total = 0
    # Whole documents, not lines: the pre-tokenizer's whitespace runs cross line ends.
    numbered = ((batch, check.reserve(len(batch))) for batch in _batches(docs, _BATCH_CHARS))
    encode = lambda job: check.encode([doc.text for doc in job[0]], job[1])  # noqa: E731
    for (batch, _), (flat, lengths) in pipelined(numbered, encode):
        ledger.add(domain, [split] * len(batch), ids_keys(flat, lengths))
        flat = np.insert(flat, np.cumsum(lengths), eos_id)  # each document, then eos
        fh.write(flat.astype(dtype).tobytes())  # not ndarray.tofile: its full-disk error has no errno
        names = np.array([doc.source for doc in batch])
        for name in np.unique(names):
            key = (str(name), split)
            counts[key] = counts.get(key, 0) + int(lengths[names == name].sum() + (names == name).sum())
        total += flat.size
    return total


def _batches(docs: list[Any], max_chars: int) -> Iterator[list[Any]]:
    batch: list[Any] = []
    size = 0
    for doc in docs:
        if batch and size + len(doc.text) > max_chars:
            yield batch
            batch, size = [], 0
        batch.append(doc)
        size += len(doc.text)
    if batch:
        yield batch
