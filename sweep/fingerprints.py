"""Which bytes each recipe's corpus holds on this machine, for the queries that decide what is a
result. Each cell run records the fingerprint of the corpus it trained on
(``experiments.corpus.Corpus.fingerprint``); a run whose fingerprint is not its corpus's here
(a ``files:`` source rewritten since, whatever was done to the cache) is no result and nothing to
resume. Run keys stay what they were: a key is computed from the grid alone, before any data is
read, and every run keyed before the fingerprint keeps counting."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from experiments.names import CORPUS_FINGERPRINT_TAG, CORPUS_TAG


def on_current_bytes(expected: dict[str, str], run: Any) -> bool:
    """Whether ``run`` trained on the bytes its corpus holds here (``expected``: recipe hash ->
    fingerprint, ``Tracker.corpus_fingerprints``). A run from before the fingerprint tag, or of a
    corpus not opened here, cannot be told and counts."""
    tags = run.data.tags
    fingerprint = expected.get(tags.get(CORPUS_TAG, ""))
    return fingerprint is None or tags.get(CORPUS_FINGERPRINT_TAG) in (None, fingerprint)


def expect_corpus(tracker: Any, corpus: Any) -> None:
    """From now on ``tracker`` (a ``sweep.store.Tracker``) counts only the runs of ``corpus``'s
    recipe that trained on its bytes."""
    tracker.corpus_fingerprints[corpus.manifest["recipe_hash"]] = corpus.fingerprint


def expect_local_corpora(tracker: Any, cells: list[Any], cache_root: Path | None = None) -> None:
    """:func:`expect_corpus` for each corpus of ``cells`` that is built in the cache (none is built
    here: a report or a scoring pass reads what is there). A corpus that cannot be opened
    (damaged) is left for the command that needs it to name."""
    from experiments.corpus import MANIFEST, CorpusError, default_cache_root, recipe_hash
    from experiments.corpus.build import open_checked

    root = Path(cache_root) if cache_root is not None else default_cache_root()
    for data in dict.fromkeys(c.config.data for c in cells):
        folder = root / f"corpus-{recipe_hash(data)}"
        if (folder / MANIFEST).is_file():
            try:
                expect_corpus(tracker, open_checked(folder))
            except CorpusError:
                continue
