"""Reading a built corpus: its layout, its manifest and its token files (see ``experiments.corpus``)."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from experiments.checksums import CHECKSUMS, Damaged, file_sha256

CORPUS_FORMAT_VERSION = 1
"""Bump whenever the build code changes what it writes (extraction, cleaning, splits, file layout, pins)."""

EOS = "<|endoftext|>"
SPLITS = ("train", "val", "test")
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"


def manifest_header(recipe: dict[str, Any], digest: str) -> dict[str, Any]:
    """The fields every ``manifest.json`` opens with: format version, recipe (``to_dict`` of the
    ``DataConfig``), its hash, the Python version and the build time (UTC)."""
    return {
        "format_version": CORPUS_FORMAT_VERSION,
        "recipe": recipe,
        "recipe_hash": digest,
        "python": platform.python_version(),
        "built_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


class CorpusError(RuntimeError):
    """A corpus could not be built or opened; the one-line message names the source (or root) and why."""


class CorpusDamaged(CorpusError, Damaged):
    """A file of a built corpus differs from what was built (``experiments.checksums``): the
    machine's state, not the grid's input."""


def default_cache_root() -> Path:
    """``$GATED_ATTN_CACHE`` if set, else ``./.cache``; absolute."""
    env = os.environ.get("GATED_ATTN_CACHE")
    return Path(env).expanduser().resolve() if env else Path(".cache").resolve()


class Corpus:
    """A built corpus directory (see the module docstring for the layout).

    Attributes:
        root: the ``corpus-<hash>`` directory.
        manifest: the parsed ``manifest.json``.
        domains: sorted unique domains of the configured sources, e.g. ``["code", "law", "literature"]``.
        eos_id: id of ``"<|endoftext|>"``, the only special token (0); it ends every document.
        vocab_size: the tokenizer's actual vocabulary (at most the recipe's ``vocab_size``).
    """

    def __init__(self, root: Path, manifest: dict[str, Any]) -> None:
        self.root = Path(root)
        self.manifest = manifest
        self.domains: list[str] = list(manifest["domains"])
        self.eos_id: int = int(manifest["tokenizer"]["eos_id"])
        self.vocab_size: int = int(manifest["tokenizer"]["vocab_size"])
        #: tokens per sequence of a synthetic task (every window starts at one), or None for text
        self.sequence_tokens: int | None = manifest.get("sequence_tokens")
        self._dtype = np.dtype(manifest["dtype"])
        self._arrays: dict[tuple[str, str | None], np.memmap] = {}
        self._tokenizer: Tokenizer | None = None

    @classmethod
    def open(cls, root: Path) -> Corpus:
        """Open a finished corpus directory.

        Raises:
            CorpusError: ``root`` has no ``manifest.json`` (not built, or not a corpus) or another format.
        """
        path = Path(root) / MANIFEST
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise CorpusError(f"corpus {root}: cannot read {MANIFEST}: {err}") from err
        if manifest.get("format_version") != CORPUS_FORMAT_VERSION:
            raise CorpusError(
                f"corpus {root}: format {manifest.get('format_version')}, expected {CORPUS_FORMAT_VERSION}"
            )
        return cls(Path(root), manifest)

    def tokens(self, split: str, domain: str | None = None) -> np.memmap:
        """Token ids of one split as a read-only 1-D memmap (dtype ``manifest["dtype"]``).

        ``"train"`` is every domain concatenated (sorted domain order; ``manifest["train_spans"]`` gives
        each domain's ``[start, end)``) and takes ``domain=None``; ``"val"`` and ``"test"`` need a domain.
        Every document is followed by :attr:`eos_id`.

        Raises:
            ValueError: unknown split, a domain given for ``"train"``, or a missing/unknown domain for
                ``"val"``/``"test"``; the message lists the allowed values.
        """
        if split not in SPLITS:
            raise ValueError(f"unknown split '{split}'; allowed: {', '.join(SPLITS)}")
        if split == "train" and domain is not None:
            raise ValueError("split 'train' holds all domains; pass domain=None")
        if split != "train" and domain not in self.domains:
            raise ValueError(
                f"split '{split}' needs a domain; got {domain!r}, allowed: {', '.join(self.domains)}"
            )
        key = (split, domain)
        if key not in self._arrays:
            rel = self.manifest["files"]["train"] if domain is None else self.manifest["files"][split][domain]
            self._arrays[key] = np.memmap(self.root / rel, dtype=self._dtype, mode="r")
        return self._arrays[key]

    def provenance(self) -> dict[str, Any]:
        """What each run records of its corpus (MLflow ``corpus.json``): the recipe hash, tokens per
        split and domain, the tokenizer, and each source's version or revision, files and sha256
        (the manifest's per-document lists left out)."""
        keep = (
            "recipe_hash",
            "format_version",
            "python",
            "built_at",
            "domains",
            "dtype",
            "tokens",
            "repeats",
            "shared_with_train",
        )
        record = {k: self.manifest[k] for k in keep if k in self.manifest}
        record["tokenizer"] = self.manifest["tokenizer"]
        record["sources"] = [
            {k: v for k, v in entry.items() if k != "doc_ids"} for entry in self.manifest.get("sources", [])
        ]
        return record

    @property
    def fingerprint(self) -> str:
        """16 hex chars naming the bytes training reads: the sha256 of the token files' and the
        tokenizer's recorded sha256 (``checksums.json``, checked at every open), so two corpora
        with one fingerprint hold the same bytes, whatever their recipe, folder or build date.
        A run records it (``experiments.names.CORPUS_FINGERPRINT_TAG``)."""
        files = self.manifest["files"]
        wanted = [files["train"], *files["val"].values(), *files["test"].values()]
        wanted += [f for f in (self.manifest["tokenizer"]["file"],) if f]
        path = self.root / CHECKSUMS
        recorded = json.loads(path.read_text()) if path.is_file() else {}
        digest = hashlib.sha256()
        for rel in sorted(wanted):
            sha = recorded[rel]["sha256"] if rel in recorded else file_sha256(self.root / rel)
            digest.update(f"{rel}\0{sha}\n".encode())
        return digest.hexdigest()[:16]

    def tokenizer(self) -> Tokenizer:
        """The corpus's byte-level BPE tokenizer (loaded once, then shared).

        Raises:
            CorpusError: a synthetic corpus, which has none.
        """
        if self.manifest["tokenizer"]["file"] is None:
            raise CorpusError(f"corpus {self.root}: a synthetic task has no tokenizer")
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_file(str(self.root / self.manifest["tokenizer"]["file"]))
        return self._tokenizer
