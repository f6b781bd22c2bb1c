"""Passkey retrieval scored by log-likelihood (Mohtashami & Jaggi 2023's prompt; used by
``experiments.longctx``, Table 5 of Qiu et al.).

A haystack of filler sentences hides the needle "The pass key is NNNNN. ..." at a chosen depth;
the question "What is the pass key? The pass key is" follows. Instead of generating (tiny models
score zero), the true key's summed log-likelihood is ranked against distractor keys, which gives a
graded score: 0.5 is chance, 1 is perfect retrieval.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn

from experiments.model import KVCache

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"


def _device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def key_tokens(tokenizer: Tokenizer, key: int) -> list[int]:
    """The token ids of `` <key>``, as the key follows ``QUESTION``."""
    return tokenizer.encode(f" {key}").ids


def passkey_prefix(
    tokenizer: Tokenizer, bos_id: int, length: int, depth: float, key: int
) -> tuple[list[int], int] | None:
    """The prompt before the key, ``length`` tokens: ``bos_id``, the filler sentences cycled with
    the needle inserted at the sentence boundary nearest ``depth`` of the haystack, the question.

    Returns:
        (token ids, index of the needle's first token), or None when needle and question do not fit.
    """
    sentences = [tokenizer.encode(" " + s).ids for s in re.split(r"(?<=\.) ", FILLER)]
    needle = tokenizer.encode(" " + NEEDLE.format(key=key)).ids
    question = tokenizer.encode(" " + QUESTION).ids
    hay = length - 1 - len(needle) - len(question)
    if hay < 0:
        return None
    stream, bounds = [], [0]
    while len(stream) < hay:
        stream += sentences[(len(bounds) - 1) % len(sentences)]
        bounds.append(len(stream))
    at = min((b for b in bounds if b <= hay), key=lambda b: abs(b - depth * hay))
    return [bos_id, *stream[:at], *needle, *stream[at:hay], *question], 1 + at


@torch.no_grad()
def score_candidates(model: nn.Module, prefix: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Summed log-likelihood (nats) of each continuation after ``prefix``.

    The prefix runs once into a :class:`KVCache`, whose row is copied to every candidate
    (``KVCache.keep`` with repeated indices); the candidates then run as one batch.

    Args:
        model: any module with ``forward(tokens (B, T), cache) -> logits (B, T, V)`` that keeps
            ``cache.length``, and a ``blocks`` sequence (one cache layer each), e.g. a GatedLM.
        prefix: (P,) int64 token ids.
        candidates: (C, K) int64 token ids.

    Returns:
        (C,) float64.
    """
    device = _device(model)
    cache = KVCache(len(model.blocks))
    first = model(prefix[None].to(device), cache)[0, -1].float().log_softmax(-1)  # (V,)
    candidates = candidates.to(device)
    logp = first[candidates[:, :1]]  # (C, 1)
    if candidates.shape[1] > 1:
        cache.keep(torch.zeros(len(candidates), dtype=torch.long, device=device))
        rest = model(candidates[:, :-1], cache).float().log_softmax(-1)  # (C, K - 1, V)
        logp = torch.cat([logp, rest.gather(-1, candidates[:, 1:, None])[..., 0]], dim=1)
    return logp.double().sum(dim=1).cpu()


def draw_keys(rng: np.random.Generator, tokenizer: Tokenizer, candidates: int, key_digits: int) -> list[int]:
    """The true key, then ``candidates - 1`` distinct distractors of as many digits and tokens.

    Raises:
        ValueError: not enough such keys turned up in ``1000 * candidates`` draws.
    """
    low, high = 10 ** (key_digits - 1), 10**key_digits
    keys = [int(rng.integers(low, high))]
    n_tokens = len(key_tokens(tokenizer, keys[0]))
    for _ in range(1000 * candidates):
        key = int(rng.integers(low, high))
        if key not in keys and len(key_tokens(tokenizer, key)) == n_tokens:
            keys.append(key)
            if len(keys) == candidates:
                return keys
    raise ValueError(f"too few {key_digits}-digit keys of {n_tokens} tokens for {candidates} candidates")


def passkey_scores(
    model: nn.Module,
    tokenizer: Tokenizer,
    bos_id: int,
    length: int,
    depths: tuple[float, ...],
    trials: int,
    candidates: int,
    key_digits: int,
    seed: int = 0,
) -> list[dict[str, Any]] | None:
    """Passkey retrieval at ``length`` tokens (prompt and key), per needle depth in ``depths``
    (fractions of the haystack), ``trials`` keys each, ``candidates`` keys scored per trial.

    Trial ``t`` at depth ``i`` draws its keys from ``numpy.random.default_rng([seed, length, i, t])``:
    a true key and ``candidates - 1`` distractors with as many digits and as many tokens, so
    summed log-likelihoods compare like with like. Per trial, ``score`` is the fraction of
    distractors the true key beats (ties count half; chance 0.5) and ``top1`` is 1 when it beats
    them all, ``1 / (1 + ties)`` when tied with the best (chance ``1 / candidates``).

    Returns:
        Per depth: ``depth``, ``score`` and ``top1`` (means over trials), ``margin`` (mean true-key
        minus mean-distractor log-likelihood, nats), ``needle_at``; None when the prompt cannot fit.
    """
    rows = []
    for i, depth in enumerate(depths):
        score, top1, margin, needle_at = [], [], [], None
        for t in range(trials):
            rng = np.random.default_rng([seed, length, i, t])
            keys = draw_keys(rng, tokenizer, candidates, key_digits)
            cands = torch.tensor([key_tokens(tokenizer, k) for k in keys], dtype=torch.long)
            built = passkey_prefix(tokenizer, bos_id, length - cands.shape[1], depth, keys[0])
            if built is None:
                return None
            prefix, at = built
            needle_at = at if needle_at is None else needle_at
            s = score_candidates(model, torch.tensor(prefix, dtype=torch.long), cands)
            true, others = s[0], s[1:]
            ties = int((others == true).sum())
            score.append(float(((others < true).double() + 0.5 * (others == true).double()).mean()))
            top1.append(0.0 if bool((others > true).any()) else 1.0 / (1 + ties))
            margin.append(float(true - others.mean()))
        rows.append(
            {"depth": depth, "score": float(np.mean(score)), "top1": float(np.mean(top1))}
            | {"margin": float(np.mean(margin)), "needle_at": needle_at}
        )
    return rows
