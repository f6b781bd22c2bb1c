"""``GatedQwen3ForCausalLM``: Qwen3-MoE (or Qwen3, every layer dense) with any gate of the paper's
space at any position, for the variants transformers has no class for.

Shipped verbatim in the exported folder and loaded with ``trust_remote_code=True``; it imports only
torch and transformers. Everything but the attention (and the optional sandwich norm) is
transformers' own Qwen3-MoE code: embeddings, RoPE (YaRN through ``rope_parameters``), RMSNorm,
the top-k softmax-renormalised experts, the KV cache and the attention kernels.

The gate (Qiu et al. 2025, Section 2.1) is ``Y' = Y * act(X W)`` or ``Y + act(X W)``, with X the
layer's pre-normed input and Y the tensor at the gate's position: the SDPA output (G1, after
attention, before ``o_proj``), the values (G2), the keys (G3, after k-norm), the queries (G4,
after q-norm) or the dense output (G5, after ``o_proj``). Shapes: B batch, T tokens, H gate heads
(query heads for G1 / G4, KV heads for G2 / G3, one for G5), D channels per head (``head_dim``,
``hidden_size`` for G5), W scores per head (D elementwise, 1 headwise).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3_moe

from .configuration_gated_qwen3 import GatedQwen3Config

ACTIVATIONS = {
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "ns_sigmoid": lambda z: 0.5 + 0.5 * torch.sigmoid(z),  # Table 4 row 7: scores in [0.5, 1]
    "identity": lambda z: z,
}


def gate_heads_and_dim(config: GatedQwen3Config) -> tuple[int, int]:
    """(H, D) of the gate's position."""
    position = config.gate["position"]
    if position in ("sdpa", "query"):
        return config.num_attention_heads, config.head_dim
    if position in ("value", "key"):
        return config.num_key_value_heads, config.head_dim
    if config.gate["granularity"] == "headwise":  # G5 headwise: n_heads groups of o_proj's channels
        return config.num_attention_heads, config.hidden_size // config.num_attention_heads
    return 1, config.hidden_size


class AttentionGate(nn.Module):
    """One point of the gate space. Parameters: ``proj`` (H*W, d) for an input-dependent gate;
    ``logits`` (H, W) for an input-independent one; ``weight`` (H, D) for the RMSNorm control."""

    def __init__(self, config: GatedQwen3Config) -> None:
        super().__init__()
        self.spec = dict(config.gate)
        self.heads, self.dim = gate_heads_and_dim(config)
        self.width = self.dim if self.spec["granularity"] == "elementwise" else 1
        self.eps = config.rms_norm_eps
        kind = self.spec["kind"]
        if kind == "gate" and self.spec["input_dependent"]:
            self.proj = nn.Linear(config.hidden_size, self.heads * self.width, bias=False)
        elif kind == "gate":
            self.logits = nn.Parameter(torch.zeros(self.heads, self.width))
        elif kind == "rmsnorm":
            self.weight = nn.Parameter(torch.ones(self.heads, self.dim))

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H, D) tensor at the gate's position, (B, T, d) pre-normed input -> (B, T, H, D)."""
        kind = self.spec["kind"]
        if kind == "silu":
            return F.silu(y)
        if kind == "rmsnorm":
            return F.rms_norm(y, (self.dim,), eps=self.eps) * self.weight
        if self.spec["input_dependent"]:
            z = self.proj(x).view(*x.shape[:-1], self.heads, self.width)
        else:
            z = self.logits.expand(*y.shape[:2], self.heads, self.width)
        scores = ACTIVATIONS[self.spec["activation"]](z)
        if self.spec["sharing"] == "head_shared":  # the mean score over heads, after the activation
            scores = scores.mean(dim=-2, keepdim=True)
        return y * scores if self.spec["combine"] == "multiplicative" else y + scores


class GatedQwen3Attention(qwen3_moe.Qwen3MoeAttention):
    """Qwen3-MoE's GQA attention with the gate at its position; without ``qk_norm``, no q/k norm."""

    def __init__(self, config: GatedQwen3Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        if not config.qk_norm:
            self.q_norm, self.k_norm = nn.Identity(), nn.Identity()
        self.gate = AttentionGate(config) if config.gate else None
        self.position = config.gate["position"] if config.gate else None

    def _gated(self, position: str, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.gate(y, x) if position == self.position else y

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None, **kwargs):
        x = hidden_states  # (B, T, d)
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self._gated("query", self.q_norm(self.q_proj(x).view(shape)), x)  # G4 after q-norm
        k = self._gated("key", self.k_norm(self.k_proj(x).view(shape)), x)  # G3 after k-norm
        v = self._gated("value", self.v_proj(x).view(shape), x)  # G2
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (B, heads, T, D)
        cos, sin = position_embeddings
        q, k = qwen3_moe.apply_rotary_pos_emb(q, k, cos, sin)
        if cache is not None:  # keys and values are cached gated, as the harness's model caches them
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, qwen3_moe.eager_attention_forward
        )
        y, weights = attention(
            self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
            sliding_window=self.sliding_window, **kwargs,
        )  # fmt: skip
        y = self._gated("sdpa", y, x)  # G1: (B, T, H, D)
        out = self.o_proj(y.reshape(*x.shape[:-1], -1).contiguous())
        if self.position == "dense":  # G5 after o_proj: (B, T, d) as (B, T, H, d / H)
            heads, dim = gate_heads_and_dim(self.config)
            out = self.gate(out.view(*out.shape[:-1], heads, dim), x).reshape(out.shape)
        return out, weights


class GatedQwen3DecoderLayer(qwen3_moe.Qwen3MoeDecoderLayer):
    """Qwen3-MoE's pre-norm block with the gated attention; with ``sandwich_norm`` each sub-layer's
    output is RMSNormed again before the residual add (Table 2 row 7)."""

    def __init__(self, config: GatedQwen3Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.self_attn = GatedQwen3Attention(config, layer_idx)
        norm = (lambda: qwen3_moe.Qwen3MoeRMSNorm(config.hidden_size, config.rms_norm_eps)) if (
            config.sandwich_norm
        ) else nn.Identity  # fmt: skip
        self.post_attention_output_norm, self.post_mlp_norm = norm(), norm()

    def forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None, **kwargs):
        attended, _ = self.self_attn(
            hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
            position_ids=position_ids, cache=cache, **kwargs,
        )  # fmt: skip
        hidden_states = hidden_states + self.post_attention_output_norm(attended)
        mixed = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + self.post_mlp_norm(mixed)


class GatedQwen3PreTrainedModel(qwen3_moe.Qwen3MoePreTrainedModel):
    config_class = GatedQwen3Config
    config: GatedQwen3Config
    _no_split_modules = ["GatedQwen3DecoderLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, AttentionGate):  # zero logits (sigmoid 0.5), unit RMSNorm gains
            if hasattr(module, "logits"):
                nn.init.zeros_(module.logits)
            if hasattr(module, "weight"):
                nn.init.ones_(module.weight)


class GatedQwen3Model(GatedQwen3PreTrainedModel, qwen3_moe.Qwen3MoeModel):
    """Qwen3-MoE's decoder stack with :class:`GatedQwen3DecoderLayer` blocks."""

    def __init__(self, config: GatedQwen3Config) -> None:
        qwen3_moe.Qwen3MoePreTrainedModel.__init__(self, config)  # not Qwen3MoeModel's: its layers
        self.padding_idx, self.vocab_size = config.pad_token_id, config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            GatedQwen3DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = qwen3_moe.Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = qwen3_moe.Qwen3MoeRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.post_init()


class GatedQwen3ForCausalLM(GatedQwen3PreTrainedModel, qwen3_moe.Qwen3MoeForCausalLM):
    """The language model: ``forward(input_ids (B, T)) .logits (B, T, V)``, ``generate``."""

    def __init__(self, config: GatedQwen3Config) -> None:
        qwen3_moe.Qwen3MoePreTrainedModel.__init__(self, config)  # not Qwen3MoeForCausalLM's: its model
        self.model = GatedQwen3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.router_aux_loss_coef = config.router_aux_loss_coef
        self.num_experts, self.num_experts_per_tok = config.num_experts, config.num_experts_per_tok
        self.post_init()


__all__ = ["GatedQwen3ForCausalLM", "GatedQwen3Model", "GatedQwen3PreTrainedModel"]
