"""The paper's whole gating space as one module driven by :class:`GateConfig` (Section 2.1).

``Y' = Y * act(X W)`` (multiplicative) or ``Y' = Y + act(X W)`` (additive), where X is the
layer's pre-normalised hidden state of the token that Y belongs to. The projection ``X W`` is not
computed here: the attention layer fuses it into its q|k|v projection (one matmul, as in the
official training code, issue #11) and hands this module the gate's slice of that output.

Shapes: ``H`` gate heads (query heads for G1/G4, KV heads for G2/G3, one for G5 elementwise,
``n_heads`` channel groups for G5 headwise), ``D`` the channel width per head (``head_dim``, or
``d_model / H`` for G5), ``W`` the score width per head (``D`` elementwise, 1 headwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from experiments.config import GateConfig, ModelConfig


def _ns_sigmoid(z: torch.Tensor) -> torch.Tensor:
    # Table 4 row 7: scores constrained to [0.5, 1.0].
    return 0.5 + 0.5 * torch.sigmoid(z)


#: The gate activations by name; ``experiments.model_config.Activation`` lists the same names (a test
#: checks that the two agree).
ACTIVATIONS = {
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "ns_sigmoid": _ns_sigmoid,
    "identity": lambda z: z,
}


class AttentionGate(nn.Module):
    """Applies one :class:`GateConfig` to a tensor at its position.

    Args:
        cfg: the gate; ``cfg.kind`` ``rmsnorm`` / ``silu`` are the Table 3 controls.
        model: the model shape (head counts and widths).
    """

    def __init__(self, cfg: GateConfig, model: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.heads, self.dim = cfg.heads_and_dim(model)
        self.width = self.dim if cfg.granularity == "elementwise" else 1
        self.activation = ACTIVATIONS[cfg.activation]
        if cfg.kind == "gate" and not cfg.input_dependent:
            # Table 4 row 6: learnable q x d_k scores, zero-initialised (sigmoid(0) = 0.5); another
            # static_init starts them elsewhere (a LayerScale's 0.5 with the identity activation)
            self.static_logits = nn.Parameter(torch.full((self.heads, self.width), cfg.static_init))
        if cfg.kind == "rmsnorm":
            self.norm = nn.RMSNorm(self.dim, eps=model.norm_eps, elementwise_affine=False)
            self.norm_weight = nn.Parameter(torch.ones(self.heads, self.dim))
        #: When not None, ``forward`` stores the last gate scores here (B, T, H or 1, W); for probes.
        self.recorded_scores: torch.Tensor | None = None
        self.record = False
        #: When True, ``forward`` returns its input unchanged (``experiments.init_stats`` compares).
        self.bypass = False

    def scores(self, logits: torch.Tensor | None, batch_shape: tuple[int, int]) -> torch.Tensor:
        """Gate scores act(XW), shape (B, T, H, W), or (B, T, 1, W) when head-shared.

        Head-shared averages the scores (after the activation) over the heads, the paper's
        "average over the query head dimension q to obtain an n x d_k score".
        """
        if self.cfg.input_dependent:
            z = logits.view(*batch_shape, self.heads, self.width)
        else:
            z = self.static_logits.expand(*batch_shape, self.heads, self.width)
        s = self.activation(z)
        if self.cfg.sharing == "head_shared":
            s = s.mean(dim=-2, keepdim=True)
        return s

    def forward(self, y: torch.Tensor, logits: torch.Tensor | None) -> torch.Tensor:
        """Gate ``y``.

        Args:
            y: (B, T, H, D) values at the gate's position.
            logits: (B, T, H * W) the gate's slice of the fused projection, or None when the
                gate has no projection (input-independent gate, Table 3 controls).

        Returns:
            (B, T, H, D), the gated values.
        """
        if self.bypass:
            return y
        if self.cfg.kind == "silu":
            return F.silu(y)
        if self.cfg.kind == "rmsnorm":
            return self.norm(y) * self.norm_weight
        s = self.scores(logits, y.shape[:2])
        if self.record:
            self.recorded_scores = s.detach()
        return y * s if self.cfg.combine == "multiplicative" else y + s
