"""A byte-level BPE ``tokenizer.json`` as a tiktoken encoding that gives exactly its ids.

A byte-level BPE ``tokenizer.json`` (the one a corpus trains, or a pretrained one such as
GPT-NeoX-20B's) is rebuilt as a ``tiktoken`` encoding from its vocabulary and merges. tiktoken
merges the adjacent pair whose result has the lowest rank; ``tokenizers`` the adjacent pair listed
first among the merges. The two agree when each merge's result is ranked by the merge's place and
every merge is the one tiktoken's own rule would pick on that token's bytes, which
:func:`tiktoken_encoding` checks for every merge before it is used. Added tokens (``<|endoftext|>``
written inside a document, GPT-NeoX's runs of spaces) are cut out of the text first, leftmost
and longest first as ``tokenizers`` does; an NFC normaliser is applied to what lies between them.

Anything else (another pre-tokenizer or normaliser, BPE dropout, byte fallback, added tokens that
strip their neighbours) is encoded by ``tokenizers`` itself (``experiments.corpus.encoders``).
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

import numpy as np

#: the GPT-2 pattern ``tokenizers``' ByteLevel pre-tokenizer splits words with (``use_regex: true``)
BYTE_LEVEL_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

_NOT_IN_UTF8 = {
    0xC0,
    0xC1,
    *range(0xF5, 0x100),
}  # bytes no UTF-8 text holds (GPT-NeoX's vocabulary lacks them)


def byte_alphabet() -> dict[str, int]:
    """The byte-level alphabet: the printable character standing for each of the 256 bytes (GPT-2's
    ``bytes_to_unicode``), as ``{character: byte}``."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _merges(model: dict[str, Any]) -> list[tuple[str, str]]:
    return [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def _bpe_parts(piece: bytes, ranks: dict[bytes, int], below: int) -> list[bytes]:
    """tiktoken's merge rule on ``piece`` with the tokens ranked below ``below`` only."""
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best, at = below, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], below)
            if rank < best:
                best, at = rank, i
        if at < 0:
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


def tiktoken_encoding(spec: dict[str, Any]) -> tuple[Any, np.ndarray] | str:
    """A tiktoken encoding with the ids of the ``tokenizer.json`` ``spec`` (its parsed JSON), as
    ``(encoding, ids)``: tiktoken's token ``r`` is the tokenizer's id ``ids[r]``. Or, where the
    file's BPE is not one tiktoken reproduces, a short reason why not (a ``str``)."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return f"model {model.get('type')}"
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return f"BPE {key} {model[key]!r}"
    for key in ("byte_fallback", "ignore_merges"):
        if model.get(key):
            return f"BPE {key}"
    pre = spec.get("pre_tokenizer") or {}
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers", [])) == 1:
        pre = pre["pretokenizers"][0]
    if pre.get("type") != "ByteLevel" or pre.get("add_prefix_space") or not pre.get("use_regex", True):
        return f"pre-tokenizer {describe(pre)}"
    alphabet = byte_alphabet()
    vocab: dict[str, int] = model["vocab"]

    def to_bytes(token: str) -> bytes | None:
        try:
            return bytes(alphabet[c] for c in token)
        except KeyError:
            return None

    ranks: dict[bytes, int] = {}
    ids: list[int] = []
    for char, byte in sorted(alphabet.items(), key=lambda kv: kv[1]):
        if char not in vocab:
            if byte in _NOT_IN_UTF8:
                continue  # a Python string never holds it
            return f"byte {byte} is not in the vocabulary"
        ranks[bytes([byte])] = len(ids)
        ids.append(vocab[char])
    merges = _merges(model)
    for left, right in merges:
        token = left + right
        raw = to_bytes(token)
        if raw is None or token not in vocab or left not in vocab or right not in vocab:
            return f"merge {left!r} {right!r} is outside the byte-level vocabulary"
        if raw in ranks:
            return f"two merges give {token!r}"
        ranks[raw] = len(ids)
        ids.append(vocab[token])
    n_bytes = len(ranks) - len(merges)
    for (left, right), (raw, rank) in zip(merges, list(ranks.items())[n_bytes:]):
        if _bpe_parts(raw, ranks, rank) != [to_bytes(left), to_bytes(right)]:
            return f"merge {left!r} {right!r} is not the one tiktoken's rule picks"
    import tiktoken

    encoding = tiktoken.Encoding(
        "corpus-bpe", pat_str=BYTE_LEVEL_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )
    return encoding, np.asarray(ids, dtype=np.uint32)


def describe(part: dict[str, Any] | None) -> str:
    if not part:
        return "none"
    return part.get("type", "?") + "".join(f" {k}={v}" for k, v in part.items() if k not in ("type",))


class AddedTokens:
    """Cuts a tokenizer's added tokens out of a text as ``tokenizers`` does: the ones matched on
    the raw text, then the normaliser (NFC or none) on each piece between them, then the ones
    matched on normalised text; leftmost, longest first."""

    def __init__(self, added: list[dict[str, Any]], nfc: bool) -> None:
        self.nfc = nfc

        # A normalised token is matched as the normaliser makes its content (``tokenizers`` does
        # so): under NFC, U+212B (Angstrom sign) is matched as U+00C5.
        def seen_as(a: dict[str, Any]) -> str:
            return unicodedata.normalize("NFC", a["content"]) if nfc and a.get("normalized") else a["content"]

        self.ids = {seen_as(a): a["id"] for a in added}
        raw = [a["content"] for a in added if not a.get("normalized")]
        normal = [seen_as(a) for a in added if a.get("normalized")]
        self.raw, self.normal = _union(raw), _union(normal)
        self.any = _union(raw + normal)
        self.few = sorted(self.ids) if len(self.ids) <= 4 else None  # `in` is faster than a regex

    def plain(self, text: str) -> bool:
        """Whether ``text`` holds no added token and the normaliser leaves it as it is (NFC never
        makes one of the added tokens this encodes with: spaces, ASCII punctuation, letters)."""
        if self.few is not None:
            found = any(token in text for token in self.few)
        else:
            found = self.any is not None and self.any.search(text) is not None
        return not found and (not self.nfc or unicodedata.is_normalized("NFC", text))

    def pieces(self, text: str) -> list[str | int]:
        """``text`` as pieces to encode (``str``) and added-token ids (``int``), in order."""
        out: list[str | int] = []
        for piece in _cut(text, self.raw, self.ids):
            if isinstance(piece, int):
                out.append(piece)
                continue
            piece = unicodedata.normalize("NFC", piece) if self.nfc else piece
            out.extend(_cut(piece, self.normal, self.ids))
        return out


def _union(contents: list[str]) -> re.Pattern[str] | None:
    # Longest first: Python's alternation takes the first that matches at the leftmost position.
    ordered = sorted(set(contents), key=lambda s: (-len(s), s))
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


def _cut(text: str, pattern: re.Pattern[str] | None, ids: dict[str, int]) -> list[str | int]:
    if pattern is None:
        return [text] if text else []
    out: list[str | int] = []
    start = 0
    for match in pattern.finditer(text):
        if match.start() > start:
            out.append(text[start : match.start()])
        out.append(ids[match.group()])
        start = match.end()
    if start < len(text):
        out.append(text[start:])
    return out
