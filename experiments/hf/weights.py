"""A :class:`~experiments.model.GatedLM` state dict in the names and layouts of its transformers class.

Every tensor is copied or reshaped, never recomputed, except Qwen3-Next's RMSNorm gains, stored as
``w - 1`` (its norm multiplies by ``1 + w``; for a gain in [0.5, 2] both steps are exact in float).

- The fused ``in_proj`` (columns ``[q | k | v | gate]``) splits into ``q_proj``, ``k_proj``,
  ``v_proj`` and the gate's projection. Qwen3-Next's ``q_proj`` emits ``[q_h | gate_h]`` per head
  h; a headwise gate's one row per head is repeated over the head's ``head_dim`` channels (the
  same sigmoid multiplies each of them).
- The SwiGLU's fused ``gate_up`` (rows ``[gate | up]``) splits into ``gate_proj`` and ``up_proj``.
- The experts' ``w_gate_up`` (E, d, 2f) and ``w_down`` (E, f, d) are transposed to transformers'
  ``gate_up_proj`` (E, 2f, d) and ``down_proj`` (E, d, f); ``router.weight`` (E, d) is ``gate.weight``.
"""

from __future__ import annotations

import torch

from experiments.config import ModelConfig
from experiments.hf.layout import GATED, QWEN3_NEXT, family


def hf_state_dict(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``GatedLM(cfg).state_dict()`` -> the state dict of ``cfg``'s transformers class
    (:func:`experiments.hf.layout.family`), float32, contiguous, no tensor shared.

    Raises:
        KeyError: ``state`` lacks a tensor of ``cfg``'s model.
    """
    name = family(cfg)
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm.weight"]}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.n_layers):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        out[theirs + "input_layernorm.weight"] = state[ours + "attn_norm.weight"]
        out[theirs + "post_attention_layernorm.weight"] = state[ours + "ffn_norm.weight"]
        out |= _attention(cfg, name, state, ours + "attn.", theirs + "self_attn.")
        out |= _ffn(cfg, name, state, ours + "ffn.", theirs + "mlp.")
        if cfg.sandwich_norm:
            out[theirs + "post_attention_output_norm.weight"] = state[ours + "attn_post_norm.weight"]
            out[theirs + "post_mlp_norm.weight"] = state[ours + "ffn_post_norm.weight"]
    if name == QWEN3_NEXT:  # (1 + w) RMSNorm gains, q/k norms included
        out = {k: v - 1.0 if k.endswith("norm.weight") else v for k, v in out.items()}
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def _attention(
    cfg: ModelConfig, name: str, state: dict[str, torch.Tensor], ours: str, theirs: str
) -> dict[str, torch.Tensor]:
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    q, k, v, gate = state[ours + "in_proj.weight"].split(
        [q_dim, kv_dim, kv_dim, cfg.gate_projection_width()], dim=0
    )
    out = {
        theirs + "k_proj.weight": k,
        theirs + "v_proj.weight": v,
        theirs + "o_proj.weight": state[ours + "o_proj.weight"],
    }
    if cfg.qk_norm:
        out[theirs + "q_norm.weight"] = state[ours + "q_norm.weight"]
        out[theirs + "k_norm.weight"] = state[ours + "k_norm.weight"]
    if name == QWEN3_NEXT:
        d, h = cfg.head_dim, cfg.n_heads
        per_head = gate.view(h, -1, cfg.d_model).expand(h, d, cfg.d_model)  # headwise: one row, D times
        out[theirs + "q_proj.weight"] = torch.cat([q.view(h, d, -1), per_head], dim=1).reshape(2 * q_dim, -1)
        return out
    out[theirs + "q_proj.weight"] = q
    if name == GATED and cfg.gate is not None:
        if gate.shape[0]:
            out[theirs + "gate.proj.weight"] = gate
        if ours + "gate.static_logits" in state:
            out[theirs + "gate.logits"] = state[ours + "gate.static_logits"]
        if ours + "gate.norm_weight" in state:
            out[theirs + "gate.weight"] = state[ours + "gate.norm_weight"]
    return out


def _ffn(
    cfg: ModelConfig, name: str, state: dict[str, torch.Tensor], ours: str, theirs: str
) -> dict[str, torch.Tensor]:
    if cfg.moe is None:
        gate, up = state[ours + "gate_up.weight"].chunk(2, dim=0)
        return {
            theirs + "gate_proj.weight": gate,
            theirs + "up_proj.weight": up,
            theirs + "down_proj.weight": state[ours + "down.weight"],
        }
    out = {
        theirs + "gate.weight": state[ours + "router.weight"],
        theirs + "experts.gate_up_proj": state[ours + "w_gate_up"].transpose(1, 2),
        theirs + "experts.down_proj": state[ours + "w_down"].transpose(1, 2),
    }
    if name == QWEN3_NEXT:  # the shared expert, zero-wide: it adds an empty sum, exactly 0
        d = cfg.d_model
        out[theirs + "shared_expert.gate_proj.weight"] = torch.zeros(0, d)
        out[theirs + "shared_expert.up_proj.weight"] = torch.zeros(0, d)
        out[theirs + "shared_expert.down_proj.weight"] = torch.zeros(d, 0)
        out[theirs + "shared_expert_gate.weight"] = torch.zeros(1, d)
    return out
