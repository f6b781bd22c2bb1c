"""Which transformers class carries a model, and its ``config.json``.

- ``qwen3`` (``Qwen3ForCausalLM``): a dense model without a gate (Table 1's dense twins, Table 2's
  baseline rows).
- ``qwen3_moe`` (``Qwen3MoeForCausalLM``): a MoE model without a gate (Table 1 rows 1-4: the
  baseline and the parameter-expanding rows; top-k softmax renormalised, ``norm_topk_prob``).
- ``qwen3_next`` (``Qwen3NextForCausalLM``): the G1 gate that Qwen3-Next has (SDPA output,
  multiplicative sigmoid, input-dependent, head-specific; elementwise, or headwise as elementwise
  with each head's score repeated over its channels). Every layer full attention
  (``layer_types``), RoPE on the whole head (``partial_rotary_factor`` 1), and the shared expert
  of its MoE block zero-wide (``shared_expert_intermediate_size`` 0): its output is an empty sum,
  exactly 0, so the block adds exactly nothing. A dense model lists every layer in
  ``mlp_only_layers``: the plain SwiGLU path, no shared expert at all.
- ``gated_qwen3`` (the custom code beside this module, ``trust_remote_code``): everything else
  (G2-G5, G1 with SiLU / additive / NS-sigmoid / head-shared / input-independent scores, the
  Table 3 controls), and any model with sandwich norm or without qk-norm, which no Qwen3 class has.
"""

from __future__ import annotations

from typing import Any

from experiments.config import ModelConfig, to_dict
from experiments.hf.tokens import SpecialTokens
from experiments.model import YarnScaling

QWEN3, QWEN3_MOE, QWEN3_NEXT, GATED = "qwen3", "qwen3_moe", "qwen3_next", "gated_qwen3"
#: the model class ``AutoModelForCausalLM`` builds for each family
CAUSAL_LM = {
    QWEN3: "Qwen3ForCausalLM",
    QWEN3_MOE: "Qwen3MoeForCausalLM",
    QWEN3_NEXT: "Qwen3NextForCausalLM",
    GATED: "GatedQwen3ForCausalLM",
}
#: the custom code's files, copied beside ``config.json`` for :data:`GATED`
CUSTOM_CODE = ("configuration_gated_qwen3.py", "modeling_gated_qwen3.py")
AUTO_MAP = {
    "AutoConfig": "configuration_gated_qwen3.GatedQwen3Config",
    "AutoModelForCausalLM": "modeling_gated_qwen3.GatedQwen3ForCausalLM",
}


def is_qwen3_next_gate(cfg: ModelConfig) -> bool:
    """Whether the gate is Qwen3-Next's: G1, multiplicative sigmoid of an input-dependent,
    head-specific projection (elementwise or headwise)."""
    g = cfg.gate
    return g is not None and (g.position, g.kind, g.combine, g.activation, g.sharing, g.input_dependent) == (
        "sdpa", "gate", "multiplicative", "sigmoid", "head_specific", True,
    )  # fmt: skip


def family(cfg: ModelConfig) -> str:
    """:data:`QWEN3`, :data:`QWEN3_MOE`, :data:`QWEN3_NEXT` or :data:`GATED` (module docstring)."""
    if cfg.sandwich_norm or not cfg.qk_norm:
        return GATED
    if cfg.gate is None:
        return QWEN3 if cfg.moe is None else QWEN3_MOE
    return QWEN3_NEXT if is_qwen3_next_gate(cfg) else GATED


def rope_parameters(cfg: ModelConfig, yarn: YarnScaling | None) -> dict[str, Any]:
    """transformers' ``rope_parameters``: plain RoPE at ``rope_theta``, or YaRN with the
    harness's parameters (``experiments.model.rope_inv_freq`` computes what transformers'
    ``_compute_yarn_parameters`` does, truncated correction range included)."""
    if yarn is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    out = {
        "rope_type": "yarn",
        "rope_theta": cfg.rope_theta,
        "factor": yarn.factor,
        "original_max_position_embeddings": yarn.original_max_position,
        "beta_fast": yarn.beta_fast,
        "beta_slow": yarn.beta_slow,
        "truncate": True,
    }
    if yarn.attention_factor is not None:
        out["attention_factor"] = yarn.attention_factor
    return out


def config_fields(
    cfg: ModelConfig, tokens: SpecialTokens, yarn: YarnScaling | None = None, max_positions: int | None = None
) -> tuple[str, dict[str, Any]]:
    """(family, the keyword arguments of its transformers config class).

    Args:
        cfg: the trained model's shape.
        tokens: the tokenizer's end, padding and beginning ids (``experiments.hf.tokens``).
        yarn: YaRN at inference (Table 5), or None: the RoPE the model was trained with.
        max_positions: ``max_position_embeddings``; default ``cfg.max_seq_len``.
    """
    name = family(cfg)
    fields: dict[str, Any] = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.d_model,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": max_positions or cfg.max_seq_len,
        "rope_parameters": rope_parameters(cfg, yarn),
        "attention_bias": False,
        "initializer_range": cfg.init_std,
        "eos_token_id": tokens.eos_id,
        "pad_token_id": tokens.pad_id,
        "bos_token_id": tokens.bos_id,
    }
    dense = list(range(cfg.n_layers)) if cfg.moe is None else []
    if cfg.moe is None:
        fields["intermediate_size"] = cfg.effective_ffn_dim()
    else:
        fields |= {
            "num_experts": cfg.moe.n_experts,
            "num_experts_per_tok": cfg.moe.top_k,
            "moe_intermediate_size": cfg.moe.expert_dim,
            "norm_topk_prob": True,  # the harness renormalises the top-k probabilities
            "decoder_sparse_step": 1,
        }
    if name == QWEN3_NEXT:
        fields["rope_parameters"]["partial_rotary_factor"] = 1.0
        fields |= {
            "layer_types": ["full_attention"] * cfg.n_layers,
            "shared_expert_intermediate_size": 0,
            "mlp_only_layers": dense,
        }
    elif name == GATED:
        fields |= {
            "gate": None if cfg.gate is None else to_dict(cfg.gate),
            "qk_norm": cfg.qk_norm,
            "sandwich_norm": cfg.sandwich_norm,
            "mlp_only_layers": dense,
            "auto_map": AUTO_MAP,
        }
        if cfg.moe is None:
            fields["num_experts"] = 0
    return name, fields
