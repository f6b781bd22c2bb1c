"""The next-token loss: cross-entropy of the LM head's logits, whole or a chunk of tokens at a time.

The whole loss makes the (N, V) logits of all N tokens at once, and its backward holds about three
fp32 buffers of that size (the cast logits, the log-softmax, the logits' gradient): at the paper's
micro-batch of 4 x 4096 tokens and 151,936 ids, 9.3 GiB each. The chunked loss (as torchtitan,
OLMo-core and Liger-Kernel compute it) applies the LM head to ``train.loss_chunk`` tokens at a
time and recomputes a chunk's logits in the backward pass (``torch.utils.checkpoint``), so no
buffer larger than a chunk's ever exists, for one more LM-head matmul a step. It sums the same
per-token losses in another order: equal to the whole loss within float rounding
(``tests/test_memory.py``: 1e-6 on a CPU), not bit for bit, so it is off (``loss_chunk: 0``) at
the CPU scales and on where a grid asks for it (``small``, ``paper``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


def next_token_loss(
    model: nn.Module, batch: torch.Tensor, reduction: str = "mean", chunk: int = 0
) -> torch.Tensor:
    """Next-token cross-entropy (nats, fp32) of ``model`` on (B, T + 1) token windows: the mean, or
    with ``reduction="sum"`` the sum over the B * T predicted tokens. ``chunk`` > 0: the LM head
    and the loss a chunk of that many tokens at a time (:func:`chunked_cross_entropy`). One
    function, so ``torch.compile`` fuses the logits' cast into the loss."""
    targets = batch[:, 1:].flatten()
    if not chunk:
        logits = model(batch[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), targets, reduction=reduction)
    hidden = model(batch[:, :-1], head=False)  # (B, T, d): the final norm's output
    return chunked_cross_entropy(hidden.flatten(0, 1), model.lm_head.weight, targets, chunk, reduction)


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, reduction: str = "mean"
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight).float(), targets)`` computed ``chunk`` tokens at
    a time, each chunk's logits recomputed in the backward pass instead of kept.

    Args:
        hidden: (N, d) the LM head's input; weight: (V, d) the LM head (under autocast its matmul
            runs in the autocast dtype, as ``nn.Linear`` does); targets: (N,) token ids;
        chunk: tokens a chunk (the last may be shorter); reduction: ``mean`` or ``sum``.

    Returns:
        the 0-d fp32 loss (nats).
    """
    total = None
    for h, y in zip(hidden.split(chunk), targets.split(chunk)):
        part = checkpoint(_chunk_nll, h, weight, y, use_reentrant=False)
        total = part if total is None else total + part
    return total / targets.numel() if reduction == "mean" else total


def _chunk_nll(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
