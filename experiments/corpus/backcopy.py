"""The Bigram-Backcopy task (Guo et al. 2024, arXiv 2410.13835, Section 2), generated offline.

Sequences are ``<bos> x_1 .. x_{L-1}`` over the ids ``0 .. tokens`` (0 is ``<bos>``). The
bigram law ``P`` has one Dirichlet(``concentration``) row per ordinary token over the ordinary
tokens, drawn from ``chain_seed``; its ``triggers`` most frequent tokens under the stationary law
are the triggers and are relabelled ``1 .. triggers``. ``x_1`` follows the stationary law with
the triggers removed; after a trigger the next token copies the token before the trigger;
otherwise it is drawn from ``P(. | x_t)``. A trigger is never followed by a trigger, so the copy
is always of an ordinary token.

Only the copy step needs attention (to the token two back); everywhere else the next token
depends on the current one alone, which the residual stream already holds. Guo et al. find that
the heads learn to do nothing there by attending to ``<bos>``: a first-token attention sink.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from experiments.config import BackcopyConfig, DataConfig, to_dict
from experiments.corpus.reader import MANIFEST, manifest_header

BOS = 0
DOMAIN = "backcopy"
SPLIT_STREAMS = {"train": 1, "val": 2, "test": 3}  # independent random streams per split


def bigram_law(cfg: BackcopyConfig) -> tuple[np.ndarray, np.ndarray]:
    """The task's bigram law and start law.

    Returns:
        ``(P, start)``: ``P`` (V, V) float64 with V = ``cfg.vocab_size``, row ``a`` the law of
        the token after ``a`` (row and column 0, ``<bos>``, are zero: nothing follows or
        becomes ``<bos>``); ``start`` (V,), the law of ``x_1``: the stationary law of ``P``
        with the triggers removed, renormalised. The triggers are ids ``1 .. cfg.triggers``,
        the most frequent tokens under the stationary law, in decreasing frequency.
    """
    rng = np.random.default_rng([cfg.chain_seed, 0])
    n = cfg.tokens
    rows = rng.dirichlet(np.full(n, cfg.concentration), size=n)  # (n, n) over ordinary tokens
    stationary = np.full(n, 1.0 / n)
    for _ in range(1000):  # power iteration; Dirichlet rows are irreducible with probability 1
        stationary = stationary @ rows
    order = np.argsort(-stationary, kind="stable")  # new id i + 1 is old token order[i]
    rows = rows[np.ix_(order, order)]
    stationary = stationary[order]
    law = np.zeros((n + 1, n + 1))
    law[1:, 1:] = rows
    start = np.zeros(n + 1)
    start[1 + cfg.triggers :] = stationary[cfg.triggers :]
    return law, start / start.sum()


def generate(cfg: BackcopyConfig, n_seqs: int, split: str) -> np.ndarray:
    """``n_seqs`` sequences of ``cfg.seq_tokens`` tokens of ``split``'s random stream.

    Deterministic in (``cfg``, ``n_seqs``, ``split``); the splits draw from independent streams.

    Returns:
        (n_seqs, seq_tokens) uint16, column 0 all ``<bos>``.

    Raises:
        KeyError: ``split`` is not train, val or test.
    """
    law, start = bigram_law(cfg)
    cumulative = np.cumsum(law, axis=1)
    cumulative[:, -1] = 1.0  # guard the inverse CDF against rounding
    rng = np.random.default_rng([cfg.chain_seed, SPLIT_STREAMS[split]])
    seqs = np.zeros((n_seqs, cfg.seq_tokens), dtype=np.int64)
    seqs[:, 1] = rng.choice(len(start), size=n_seqs, p=start)
    for t in range(2, cfg.seq_tokens):
        current = seqs[:, t - 1]
        drawn = (rng.random(n_seqs)[:, None] > cumulative[current]).sum(axis=1)
        seqs[:, t] = np.where(current <= cfg.triggers, seqs[:, t - 2], drawn)
    return seqs.astype(np.uint16)


def copy_positions(seqs: np.ndarray, triggers: int) -> np.ndarray:
    """(N, L) bool: the positions whose token was copied (the previous token is a trigger)."""
    copied = np.zeros(seqs.shape, dtype=bool)
    copied[:, 2:] = (seqs[:, 1:-1] >= 1) & (seqs[:, 1:-1] <= triggers)
    return copied


def task_entropy(cfg: BackcopyConfig) -> float:
    """The best achievable next-token loss (nats per predicted token) of ``<bos>``-started
    windows of the whole sequence, estimated on 2,000 test sequences: copies cost 0, ``x_1``
    costs the start law's entropy and every other token its bigram row's entropy."""
    law, start = bigram_law(cfg)
    with np.errstate(divide="ignore", invalid="ignore"):
        row_entropy = -np.nansum(np.where(law > 0, law * np.log(law), 0.0), axis=1)
        start_entropy = -np.sum(np.where(start > 0, start * np.log(start), 0.0))
    seqs = generate(cfg, 2000, "test").astype(np.int64)
    copied = copy_positions(seqs, cfg.triggers)
    costs = np.where(copied[:, 2:], 0.0, row_entropy[seqs[:, 1:-1]])
    return float((start_entropy * len(seqs) + costs.sum()) / (len(seqs) * (cfg.seq_tokens - 1)))


def write_corpus(data: DataConfig, digest: str, out: Path, log: Callable[[str], None]) -> None:
    """Write the task's corpus directory (``experiments.corpus`` layout, one domain ``backcopy``,
    no tokenizer) into ``out``; the manifest, written last, records ``sequence_tokens`` so every
    window starts at a ``<bos>``."""
    t0 = time.perf_counter()
    cfg = data.synthetic
    counts = {"train": cfg.train_seqs, "val": cfg.heldout_seqs, "test": cfg.heldout_seqs}
    files: dict[str, Any] = {"train": "train.bin", "val": {}, "test": {}}
    totals: dict[str, dict[str, int]] = {}
    for split, n in counts.items():
        rel = files["train"] if split == "train" else f"{split}/{DOMAIN}.bin"
        if split != "train":
            files[split][DOMAIN] = rel
            (out / split).mkdir()
        seqs = generate(cfg, n, split)
        (out / rel).write_bytes(seqs.tobytes())  # not tofile: a full disk then says so
        totals[split] = {DOMAIN: int(seqs.size)}
    manifest = {
        **manifest_header(to_dict(data), digest),
        "domains": [DOMAIN],
        "dtype": "uint16",
        "tokenizer": {"file": None, "vocab_size": cfg.vocab_size, "eos_id": BOS, "eos": "<bos>"},
        "files": files,
        "tokens": totals,
        "train_spans": {DOMAIN: [0, totals["train"][DOMAIN]]},
        "sequence_tokens": cfg.seq_tokens,
        "task": {"name": "bigram_backcopy", "best_loss_nats": task_entropy(cfg)},
        "sources": [],
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    seconds = time.perf_counter() - t0
    log(f"corpus {digest}: Bigram-Backcopy, {cfg.train_seqs:,} train sequences in {seconds:.1f}s")
