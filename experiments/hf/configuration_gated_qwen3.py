"""The configuration of ``GatedQwen3ForCausalLM``: Qwen3-MoE's, plus the attention gate.

Shipped verbatim in every exported folder whose variant transformers has no class for, and loaded
with ``trust_remote_code=True``. It imports only transformers.

``gate`` holds the fields of the harness's ``experiments.config.GateConfig`` (Qiu et al. 2025,
Section 2.1), as a plain dict, or None for no gate:

- ``position``: ``sdpa`` (G1), ``value`` (G2), ``key`` (G3), ``query`` (G4), ``dense`` (G5);
- ``kind``: ``gate``, or a Table 3 control on the SDPA output: ``rmsnorm`` (per-head RMSNorm),
  ``silu`` (parameter-free SiLU);
- ``granularity``: ``elementwise`` | ``headwise``; ``sharing``: ``head_specific`` | ``head_shared``;
- ``combine``: ``multiplicative`` | ``additive``;
- ``activation``: ``sigmoid`` | ``silu`` | ``ns_sigmoid`` (0.5 + 0.5 sigmoid) | ``identity``;
- ``input_dependent``: False is one learned score per channel for every token (Table 4 row 6).

A dense model lists every layer in ``mlp_only_layers`` (its FFN width is ``intermediate_size``).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig


@strict
class GatedQwen3Config(Qwen3MoeConfig):
    model_type = "gated_qwen3"

    gate: dict | None = None
    qk_norm: bool = True
    sandwich_norm: bool = False
