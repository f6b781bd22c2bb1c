"""What the corpus builds encode documents with: tiktoken where it gives exactly the ids of HF
``tokenizers`` (``experiments.corpus.fast_bpe``), else ``tokenizers`` itself, and a check of the
two on a sample of every build's documents.

Both encoders take a batch of texts and give ``(ids, lengths)``: the texts' ids one after another,
``(sum(lengths),)`` uint32, and each text's count, ``(len(texts),)`` int64, so that what follows
(end-of-document tokens, splits, writing) is done on the whole batch with numpy.
"""

from __future__ import annotations

import collections
import json
import os
import unicodedata
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

import numpy as np
from tokenizers import Tokenizer

from experiments.corpus.fast_bpe import AddedTokens, describe, tiktoken_encoding

ENGINE_ENV = "GATED_ATTN_ENCODER"
"""``tokenizers`` in the environment: encode with HF ``tokenizers`` whatever the file (the benchmark's
comparison; a way out should tiktoken ever be doubted)."""

CHECK_FIRST = 16
CHECK_EVERY = 499


Batch = TypeVar("Batch")


class Mismatch(RuntimeError):
    """tiktoken and ``tokenizers`` gave different ids for a sampled document: encode with ``tokenizers``."""


class DocumentEncoder(Protocol):
    """``encode(texts)`` gives ``(ids, lengths)`` (see the module docstring); ``engine`` names it."""

    engine: str

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]: ...


def _joined(chunks: list[tuple[array, list[int]]]) -> tuple[np.ndarray, np.ndarray]:
    ids = [np.frombuffer(flat, dtype=np.uint32) for flat, _ in chunks]
    lengths = [n for _, counts in chunks for n in counts]
    flat = np.concatenate(ids) if ids else np.zeros(0, dtype=np.uint32)
    return flat, np.asarray(lengths, dtype=np.int64)


class TiktokenEncoder:
    """tiktoken on ``threads`` threads; the ids ``tokenizers`` gives, the post-processor's ``prefix``
    and ``suffix`` ids around each document (``add_special_tokens``)."""

    engine = "tiktoken"

    def __init__(
        self, encoding: Any, ids: np.ndarray, added: AddedTokens, prefix: list[int], suffix: list[int],
        threads: int,
    ) -> None:  # fmt: skip
        self.encoding, self.added, self.threads = encoding, added, threads
        # Ranks past tiktoken's stand for the added tokens and the post-processor's ids.
        extra = sorted({*added.ids.values(), *prefix, *suffix})
        self.rank_of = {token: len(ids) + k for k, token in enumerate(extra)}
        self.lut = np.concatenate([ids, np.asarray(extra, dtype=np.uint32)])
        self.prefix = [self.rank_of[t] for t in prefix]
        self.suffix = [self.rank_of[t] for t in suffix]
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="tiktoken")

    def _ranks(self, text: str) -> list[int]:
        if self.added.plain(text):
            return self.encoding.encode_ordinary(text)  # releases the GIL while it works
        ranks: list[int] = []
        for piece in self.added.pieces(text):
            if isinstance(piece, int):
                ranks.append(self.rank_of[piece])
            else:
                ranks.extend(self.encoding.encode_ordinary(piece))
        return ranks

    def _chunk(self, texts: Sequence[str]) -> tuple[array, list[int]]:
        flat, counts = array("I"), []
        for text in texts:
            ranks = self._ranks(text)
            flat.extend(self.prefix)
            flat.extend(ranks)
            flat.extend(self.suffix)
            counts.append(len(self.prefix) + len(ranks) + len(self.suffix))
        return flat, counts

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """The texts' ids and counts (see the module docstring)."""
        # A few chunks a thread, cut at equal shares of the characters: a batch may hold one large
        # document among many small ones (a corpus of whole source files).
        sizes = np.cumsum([len(text) for text in texts])
        parts = 4 * self.threads
        cuts = np.searchsorted(sizes, sizes[-1] * np.arange(1, parts) / parts, side="right") if texts else []
        bounds = sorted({0, *map(int, cuts), len(texts)})
        pieces = [texts[a:b] for a, b in zip(bounds, bounds[1:])]
        chunks = list(self.pool.map(self._chunk, pieces))
        flat, lengths = _joined(chunks)
        return self.lut[flat], lengths


class TokenizersEncoder:
    """HF ``tokenizers`` itself, on every core."""

    engine = "tokenizers"

    def __init__(self, tokenizer: Tokenizer, add_special_tokens: bool) -> None:
        self.tokenizer, self.add_special_tokens = tokenizer, add_special_tokens

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """The texts' ids and counts (see the module docstring)."""
        encodings = self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=self.add_special_tokens)
        flat = array("I")
        for encoding in encodings:
            flat.extend(encoding.ids)
        return _joined([(flat, [len(e.ids) for e in encodings])])


def _around(tokenizer: Tokenizer) -> tuple[list[int], list[int]] | None:
    """The ids the post-processor puts before and after a document's own, or ``None`` if it does
    something else."""
    plain = tokenizer.encode("a b", add_special_tokens=False).ids
    full = tokenizer.encode("a b", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start], full[start + len(plain) :]
    return None


def _unsupported(spec: dict[str, Any], tokenizer: Tokenizer, add_special_tokens: bool) -> str | None:
    normalizer = spec.get("normalizer")
    if normalizer and normalizer.get("type") != "NFC":
        return f"normalizer {describe(normalizer)}"
    for added in spec.get("added_tokens", []):
        if added.get("lstrip") or added.get("rstrip") or added.get("single_word"):
            return f"added token {added['content']!r} strips or matches whole words"
    if add_special_tokens and _around(tokenizer) is None:
        return f"post-processor {describe(spec.get('post_processor'))}"
    if os.environ.get(ENGINE_ENV) == "tokenizers":
        return f"{ENGINE_ENV}=tokenizers"
    return None


def document_encoder(
    tokenizer: Tokenizer, add_special_tokens: bool, log: Callable[[str], None], threads: int | None = None
) -> DocumentEncoder:
    """The fastest exact encoder of ``tokenizer`` as :func:`~Tokenizer.encode_batch_fast` would
    encode: tiktoken, or ``tokenizers`` after one line of ``log`` saying why not."""
    spec = json.loads(tokenizer.to_str())
    reason = _unsupported(spec, tokenizer, add_special_tokens)
    built = tiktoken_encoding(spec) if reason is None else reason
    if isinstance(built, str):
        log(f"corpus: encoding with HF tokenizers, not tiktoken: {built}")
        return TokenizersEncoder(tokenizer, add_special_tokens)
    prefix, suffix = _around(tokenizer) if add_special_tokens else ([], [])  # type: ignore[misc]
    nfc = (spec.get("normalizer") or {}).get("type") == "NFC"
    special_as_text = tokenizer.encode_special_tokens  # then special tokens in the text are plain text
    added = [a for a in spec.get("added_tokens", []) if not (a.get("special") and special_as_text)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    fast = TiktokenEncoder(built[0], built[1], AddedTokens(added, nfc), prefix, suffix, threads or cores)
    if (
        differs := _first_difference(fast, TokenizersEncoder(tokenizer, add_special_tokens), spec)
    ) is not None:
        log(f"corpus: encoding with HF tokenizers, not tiktoken: they differ on {differs!r}")
        return TokenizersEncoder(tokenizer, add_special_tokens)
    return fast


#: texts the normaliser changes or leaves: decomposed and composed accents, the Angstrom and
#: Kelvin signs, a ligature, full-width letters, Hangul jamo
_NORMALISER_PROBES = (
    "e\u0301te\u0301 \u00e9t\u00e9",
    "\u212b \u00c5 A\u030a",
    "\u212a K",
    "\ufb01ne",
    "\uff21\uff22",
    "\u1100\u1161",
)


def _probes(spec: dict[str, Any]) -> list[str]:
    """Texts on which tiktoken's rebuild of ``spec`` is most likely to differ: each added token
    alone, between letters, twice, and as each Unicode normal form makes it; then
    :data:`_NORMALISER_PROBES`."""
    texts: list[str] = []
    for added in spec.get("added_tokens", []):
        content = added["content"]
        for form in dict.fromkeys(
            [content, *(unicodedata.normalize(f, content) for f in ("NFC", "NFD", "NFKC"))]
        ):
            texts += [form, f"a{form}b", f" {form} ", form + form, f"x {form}{content} y"]
    return texts + list(_NORMALISER_PROBES)


def _first_difference(
    fast: TiktokenEncoder, reference: TokenizersEncoder, spec: dict[str, Any]
) -> str | None:
    """The first probe (:func:`_probes`) the two encoders give different ids, or ``None``: the
    equivalence is shown on them before a build trusts tiktoken (and checked on a sample of its
    documents as it goes, :class:`SampleCheck`)."""
    for text in _probes(spec):
        mine, theirs = fast.encode([text])[0], reference.encode([text])[0]
        if not np.array_equal(mine, theirs):
            return text
    return None


class SampleCheck:
    """``encoder`` with its ids compared with ``tokenizers``' own on a sample of the documents: the
    first :data:`CHECK_FIRST` and one in every :data:`CHECK_EVERY` after them (``tokenizers`` is
    several times slower: the sample costs about 2 % of tiktoken's time). Documents are numbered
    by :meth:`reserve`, in the build's order, so batches may be encoded out of order."""

    def __init__(self, encoder: DocumentEncoder, reference: TokenizersEncoder) -> None:
        self.encoder, self.reference, self.seen = encoder, reference, 0

    def reserve(self, count: int) -> int:
        """The build's number of the first of the next ``count`` documents."""
        self.seen += count
        return self.seen - count

    def encode(self, texts: Sequence[str], first: int) -> tuple[np.ndarray, np.ndarray]:
        """The texts' ids and counts (see the module docstring); ``first`` is the number
        :meth:`reserve` gave ``texts[0]``.

        Raises:
            Mismatch: tiktoken and ``tokenizers`` differ on a sampled document.
        """
        flat, lengths = self.encoder.encode(texts)
        if self.encoder.engine != self.reference.engine:
            ends = np.cumsum(lengths)
            at = [i for i in range(len(texts)) if (n := first + i) < CHECK_FIRST or n % CHECK_EVERY == 0]
            theirs, counts = self.reference.encode([texts[i] for i in at])
            for i, mine in zip(at, np.split(theirs, np.cumsum(counts)[:-1])):
                if not np.array_equal(flat[ends[i] - lengths[i] : ends[i]], mine):
                    raise Mismatch(f"tiktoken and tokenizers differ on document {first + i:,} of the build")
        return flat, lengths


def pipelined(
    batches: Iterable[Batch], encode: Callable[[Batch], tuple[np.ndarray, np.ndarray]], ahead: int = 2
) -> Iterator[tuple[Batch, tuple[np.ndarray, np.ndarray]]]:
    """Each batch with ``encode(batch)``, in order, up to ``ahead`` batches' encodings started before
    this one is handed over: the encoder's threads work while the caller writes, while the sample is
    checked, and while the last chunk of a batch ends (two batches in flight keep both threads of a
    2-core machine busy where one left a thread idle at each batch's end).

    Raises:
        Mismatch: as ``encode``, when the batch it concerns is reached.
    """
    with ThreadPoolExecutor(ahead, thread_name_prefix="encode-ahead") as pool:
        pending: collections.deque[tuple[Batch, Any]] = collections.deque()
        for batch in batches:
            pending.append((batch, pool.submit(encode, batch)))
            if len(pending) > ahead:
                done, job = pending.popleft()
                yield done, job.result()
        while pending:
            done, job = pending.popleft()
            yield done, job.result()
