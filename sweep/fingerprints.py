"""Which bytes each recipe's corpus holds on this machine, for the queries that decide what is a
result. Each cell run records the fingerprint of the corpus it trained on
(``experiments.corpus.Corpus.fingerprint``); a run whose fingerprint is not its corpus's here
(a ``files:`` source rewritten since, whatever was done to the cache) is no result and nothing to
resume. Run keys stay what they were: a key is computed from the grid alone, before any data is
read. A run from before the fingerprint tag counts unless its corpus moved when repeated texts
began to be kept once (``experiments.corpus.repeats``; the manifest's ``repeats.moved``): such a
run trained on the old bytes, whose validation held trained text."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from experiments.names import CORPUS_FINGERPRINT_TAG, CORPUS_TAG


class CorpusHere(NamedTuple):
    """What a recipe's corpus holds on this machine."""

    fingerprint: str
    #: whether runs from before the fingerprint tag trained on these bytes too, as far as can be
    #: told: false once dropping repeated texts moved the corpus (its manifest's ``repeats.moved``)
    untagged_count: bool


def on_current_bytes(expected: dict[str, CorpusHere], run: Any) -> bool:
    """Whether ``run`` trained on the bytes its corpus holds here (``expected``: recipe hash ->
    :class:`CorpusHere`, ``Tracker.corpus_fingerprints``). A run of a corpus not opened here
    cannot be told and counts; a run from before the fingerprint tag counts unless the corpus
    moved when repeats were dropped."""
    tags = run.data.tags
    here = expected.get(tags.get(CORPUS_TAG, ""))
    if here is None:
        return True
    tagged = tags.get(CORPUS_FINGERPRINT_TAG)
    return here.untagged_count if tagged is None else tagged == here.fingerprint


def expect_corpus(tracker: Any, corpus: Any) -> None:
    """From now on ``tracker`` (a ``sweep.store.Tracker``) counts only the runs of ``corpus``'s
    recipe that trained on its bytes."""
    repeats = corpus.manifest.get("repeats")
    untagged = repeats is None or not repeats.get("moved", False)
    tracker.corpus_fingerprints[corpus.manifest["recipe_hash"]] = CorpusHere(corpus.fingerprint, untagged)


def expect_local_corpora(
    tracker: Any,
    cells: list[Any],
    cache_root: Path | None = None,
    warn: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> None:
    """:func:`expect_corpus` for each corpus of ``cells`` that is built in the cache (none is built
    here: a report or a scoring pass reads what is there). A corpus that cannot be opened
    (damaged) is left for the command that needs it to name; one built before repeated texts
    were dropped gets one line of ``warn`` (its validation may hold trained text)."""
    from experiments.corpus import MANIFEST, CorpusError, default_cache_root, recipe_hash
    from experiments.corpus.build import before_repeats_rule, open_checked

    root = Path(cache_root) if cache_root is not None else default_cache_root()
    for data in dict.fromkeys(c.config.data for c in cells):
        folder = root / f"corpus-{recipe_hash(data)}"
        if (folder / MANIFEST).is_file():
            try:
                corpus = open_checked(folder)
            except CorpusError:
                continue
            expect_corpus(tracker, corpus)
            if before_repeats_rule(corpus):
                warn(
                    f"corpus {folder} was built before repeated texts were kept once, so its "
                    "validation may hold trained text: `make data` builds it again and `make sweep` "
                    "trains again the cells it moved"
                )
