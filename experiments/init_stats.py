"""What the gate does to the attention branch at initialisation (issue 13: width-aware init).

With a fixed init std of 0.02, the gate logits ``XW`` of a pre-normed X have std ``0.02 sqrt(d)``:
0.23 at d = 128 against 0.905 at the paper's d = 2048, so at small width a sigmoid gate starts
nearly constant and a SiLU gate shrinks the branch several-fold. These statistics, on the probe
batch before the first step, make that visible for every run.
"""

from __future__ import annotations

import math

import torch

from experiments import names as N
from experiments.model import GatedLM
from experiments.sharding import gathered


@torch.no_grad()
def init_statistics(model: GatedLM, tokens: torch.Tensor) -> dict[str, float]:
    """Gate statistics of ``model`` on ``tokens`` (N, T), means over layers.

    - ``init/gate_logit_std``: std of the gate logits ``XW`` (entries of every token and score),
      for gates with a projection (input-dependent gates).
    - ``init/branch_scale``: RMS of each attention layer's output (after ``W_O``, and after a G5
      gate) over its RMS with the gate bypassed: 0.5 for a constant sigmoid gate of 0.5, above 1
      where a control amplifies the branch.

    Under FSDP every rank calls it (its root forward and each block's gathering are collective).

    Returns:
        The two metrics (only the second without a gate projection); ``{}`` for the baseline.
    """
    attns = [block.attn for block in model.blocks]
    if attns[0].gate is None:
        return {}
    was_training = model.training
    model.eval()
    width = attns[0].split_sizes[-1]
    inputs: list[torch.Tensor] = []
    hooks = [a.register_forward_pre_hook(lambda m, args: inputs.append(args[0])) for a in attns]
    try:
        model(tokens)
    finally:
        for h in hooks:
            h.remove()
    ratios, stds = [], []
    try:
        for block, a, x in zip(
            model.blocks, attns, inputs
        ):  # each layer on its own input, gated and bypassed
            with gathered(block):  # a sharded block's weights, whole for calls past its forward
                gated = a(x, model.rope)
                a.gate.bypass = True
                ratios.append(_rms(gated) / _rms(a(x, model.rope)))
                a.gate.bypass = False
                if width:
                    stds.append(float(a.in_proj(x)[..., -width:].double().std()))
    finally:
        for a in attns:
            a.gate.bypass = False
        model.train(was_training)
    stats = {N.BRANCH_SCALE_INIT: sum(ratios) / len(ratios)}
    if stds:
        stats[N.GATE_LOGIT_STD_INIT] = sum(stds) / len(stds)
    return stats


def _rms(x: torch.Tensor) -> float:
    return math.sqrt(float(x.double().pow(2).mean()))
