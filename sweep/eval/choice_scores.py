"""Per-document scores of the wheel tasks (``sweep.eval.wheel_tasks``), as lm-eval's
``process_results`` hooks; lm-eval averages them over the documents (``mean``) and gives each mean
its standard error (sample std / sqrt(n)).

For a document with choices c_1..c_k (each a continuation string, its leading space included),
log-likelihoods l_i (nats, summed over c_i's tokens) and gold index g:

- ``acc``: 1 if l_g is the largest, 1/m if it ties with m-1 others (the expectation of a random
  tie-break, so a model that scores every choice alike gets exactly the chance level 1/k);
- ``acc_norm``: the same over l_i / len(c_i) (characters: OLMES's ``acc_per_char``, lm-eval's
  ``acc_norm``), the standard for HellaSwag and PIQA;
- ``bpb``: -l_g / (ln 2 * bytes(c_g)), bits per UTF-8 byte of the gold continuation, which ranks
  models that all answer at chance (DataDecide, arXiv 2504.11393; OLMo's in-loop evaluation).

A continuation task (GSM8k's gold answer, LAMBADA's last word) has one choice: ``bpb``, and
``acc`` = whether greedy decoding gives the continuation (LAMBADA's accuracy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def expected_argmax_hit(scores: Sequence[float], gold: int) -> float:
    """1/m if ``scores[gold]`` is one of the m largest ties, else 0."""
    best = max(scores)
    ties = [i for i, s in enumerate(scores) if s == best]
    return 1.0 / len(ties) if gold in ties else 0.0


def bits_per_byte(loglik: float, text: str) -> float:
    """-loglik / (ln 2 * UTF-8 bytes of ``text``).

    Raises:
        ValueError: ``text`` is empty.
    """
    n = len(text.encode("utf-8"))
    if n == 0:
        raise ValueError("bits per byte of an empty continuation")
    return -loglik / (math.log(2) * n)


def process_choice(doc: dict[str, Any], results: Sequence[tuple[float, bool]]) -> dict[str, float]:
    """``acc``, ``acc_norm`` and ``bpb`` of one multiple-choice document (lm-eval hook)."""
    lls = [ll for ll, _greedy in results]
    gold, choices = doc["gold"], doc["choices"]
    per_char = [ll / len(c) for ll, c in zip(lls, choices, strict=True)]
    return {
        "acc": expected_argmax_hit(lls, gold),
        "acc_norm": expected_argmax_hit(per_char, gold),
        "bpb": bits_per_byte(lls[gold], choices[gold]),
    }


def process_continuation(doc: dict[str, Any], results: Sequence[tuple[float, bool]]) -> dict[str, float]:
    """``acc`` (greedy decoding gives the continuation) and ``bpb`` of one continuation (lm-eval hook)."""
    ((ll, greedy),) = results
    return {"acc": float(greedy), "bpb": bits_per_byte(ll, doc["choices"][0])}
