"""Decoder-only LM of the paper's shape (Table 7): pre-RMSNorm, RoPE, GQA, qk-norm, SwiGLU or MoE.

Shape legend: B batch, T tokens, d ``d_model``, H query heads, K key/value heads, D ``head_dim``,
V vocabulary. The training path uses ``torch.nn.functional.scaled_dot_product_attention``; a
:class:`KVCache` lets generation feed one token at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from experiments.config import ModelConfig
from experiments.gating import AttentionGate
from experiments.moe import MoEFFN
from experiments.strict import ConfigError


class KVCache:
    """Keys and values of every position fed so far, for incremental decoding.

    ``keys[l]`` and ``values[l]`` are layer ``l``'s (B, K, T, D), after qk-norm, the G3 / G2 gates
    and RoPE: what attention reads. ``length`` is T. :meth:`keep` drops finished sequences.
    """

    def __init__(self, n_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * n_layers
        self.values: list[torch.Tensor | None] = [None] * n_layers
        self.length = 0

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append (B, K, t, D) keys and values of the new positions; return the layer's whole cache."""
        if self.keys[layer] is not None:
            k, v = torch.cat([self.keys[layer], k], dim=2), torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the batch rows ``rows`` (int64 indices), in that order."""
        self.keys = [None if k is None else k.index_select(0, rows) for k in self.keys]
        self.values = [None if v is None else v.index_select(0, rows) for v in self.values]


@dataclass(frozen=True)
class YarnScaling:
    """YaRN context extension of RoPE (Peng et al. 2023, arXiv 2309.00071, Section 3.2 "NTK-by-parts"
    and 3.4 "YaRN"), with Hugging Face ``rope_scaling={"rope_type": "yarn", ...}``'s parameters.

    Table 5 of Qiu et al. extends the context with YaRN at inference, without further training.

    Attributes:
        factor: the scale ``s``: target context over ``original_max_position``; >= 1.
        original_max_position: the context the model was trained at (``L``), tokens.
        beta_fast: rotations per ``L`` above which a dimension is extrapolated (``beta``, Section 3.2).
        beta_slow: rotations per ``L`` below which a dimension is interpolated (``alpha``, Section 3.2).
        attention_factor: the cos / sin multiplier; None: :meth:`attention_temperature`'s default.

    Raises:
        ConfigError: a value out of range; ``path`` names the key.
    """

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None

    def __post_init__(self) -> None:
        if not self.factor >= 1.0:
            raise ConfigError("factor", f"must be >= 1, got {self.factor}")
        if not self.original_max_position > 0:
            raise ConfigError("original_max_position", f"must be positive, got {self.original_max_position}")
        for key in ("beta_fast", "beta_slow"):
            if not getattr(self, key) > 0:
                raise ConfigError(key, f"must be positive, got {getattr(self, key)}")
        if self.beta_fast < self.beta_slow:
            raise ConfigError("beta_fast", f"must be >= beta_slow={self.beta_slow}, got {self.beta_fast}")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ConfigError("attention_factor", f"must be positive, got {self.attention_factor}")

    def attention_temperature(self) -> float:
        """``sqrt(1/t) = 0.1 ln(s) + 1`` (Section 3.4; 1.0 at ``s = 1``), or ``attention_factor`` if set.
        Multiplies both cos and sin, so attention logits scale by its square (as in HF)."""
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0


def yarn_correction_range(head_dim: int, theta: float, yarn: YarnScaling) -> tuple[int, int]:
    """The (low, high) rotary-pair indices between which YaRN ramps from extrapolation to
    interpolation: ``find_correction_dim(beta) = D ln(L / (2 pi beta)) / (2 ln theta)`` (the
    pair index whose wavelength fits ``beta`` times in ``L``, Section 3.2) at ``beta_fast``
    (floored) and ``beta_slow`` (ceiled), clamped to ``[0, D - 1]`` as in HF (``truncate=True``;
    HF's upper clamp is ``D - 1``, not ``D/2 - 1``: the ramp is then cut by its own clamp)."""

    def dim(rotations: float) -> float:
        turns = yarn.original_max_position / (rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    return max(math.floor(dim(yarn.beta_fast)), 0), min(math.ceil(dim(yarn.beta_slow)), head_dim - 1)


def rope_inv_freq(head_dim: int, theta: float, yarn: YarnScaling | None = None) -> torch.Tensor:
    """RoPE inverse frequencies, (D/2,) float32, radians per token.

    Plain RoPE: ``theta ** (-2i / D)``. With ``yarn`` (factor > 1), YaRN's NTK-by-parts blend
    (Peng et al. 2023, Section 3.2 "NTK-by-parts"; HF ``_compute_yarn_parameters``): pair ``i`` gets
    ``(1 - g_i) * inv_freq_i / s + g_i * inv_freq_i`` with ``g_i = 1 - clamp((i - low) / (high -
    low), 0, 1)`` over :func:`yarn_correction_range`: high-frequency pairs (``i <= low``) are kept
    (extrapolated), low-frequency ones (``i >= high``) divided by ``s`` (interpolated). A factor of
    exactly 1 returns plain RoPE bit for bit.
    """
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolation = 1.0 / pos_freqs
    if yarn is None or yarn.factor == 1.0:
        return extrapolation
    interpolation = 1.0 / (yarn.factor * pos_freqs)
    low, high = yarn_correction_range(head_dim, theta, yarn)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)
    keep = 1 - ramp.clamp(0, 1)  # HF's inv_freq_extrapolation_factor
    return interpolation * (1 - keep) + extrapolation * keep


class RotaryEmbedding(nn.Module):
    """RoPE tables (rotate-half form) for positions ``0 .. max_seq_len - 1``: ``cos`` and ``sin``,
    (max_seq_len, D) float32 buffers, not saved in checkpoints. With ``yarn``, the frequencies of
    :func:`rope_inv_freq` and both tables times :meth:`YarnScaling.attention_temperature`."""

    def __init__(
        self, head_dim: int, max_seq_len: int, theta: float, yarn: YarnScaling | None = None
    ) -> None:
        super().__init__()
        self.theta, self.yarn = theta, yarn
        inv_freq = rope_inv_freq(head_dim, theta, yarn)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # (T, D/2)
        cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)  # (T, D)
        scale = 1.0 if yarn is None else yarn.attention_temperature()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Rotate ``x`` of shape (B, T, heads, D) by its positions ``offset .. offset + T - 1``."""
        t = x.shape[1]
        cos = self.cos[offset : offset + t, None, :].to(x.dtype)
        sin = self.sin[offset : offset + t, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    """GQA self-attention with one optional gate.

    The q, k, v and gate projections are one fused ``in_proj`` matmul whose output columns are
    ``[q (H*D) | k (K*D) | v (K*D) | gate (H_g*W)]``; the gate reads the same pre-normed input
    as the projections (paper footnote 1).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.gate = AttentionGate(cfg.gate, cfg) if cfg.gate is not None else None
        self.gate_position = cfg.gate.position if cfg.gate is not None else None
        self.split_sizes = [q_dim, kv_dim, kv_dim, cfg.gate_projection_width()]
        self.in_proj = nn.Linear(cfg.d_model, sum(self.split_sizes), bias=False)
        self.o_proj = nn.Linear(q_dim, cfg.d_model, bias=False)
        self.q_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        self.k_norm = nn.RMSNorm(cfg.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else nn.Identity()
        #: Probe mode: compute attention with an explicit softmax and keep the probabilities on
        #: key 0 (the attention sink), not the whole (B, H, T, T) map, so probing fits at scale.
        self.keep_attention = False
        self.last_attention: torch.Tensor | None = None  # (B, H, T, 1) in probe mode

    def _gated(self, position: str, y: torch.Tensor, gate_logits: torch.Tensor | None) -> torch.Tensor:
        return self.gate(y, gate_logits) if position == self.gate_position else y

    def forward(
        self, x: torch.Tensor, rope: RotaryEmbedding, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        """(B, T, d) pre-normed hidden state -> (B, T, d) attention output. With ``cache``, the
        T tokens follow the ``cache.length`` positions it holds, and their keys and values join it."""
        b, t, _ = x.shape
        offset = cache.length if cache is not None else 0
        q, k, v, g = self.in_proj(x).split(self.split_sizes, dim=-1)
        g = g if g.shape[-1] else None
        # G4 / G3 act after qk-norm: RMSNorm would undo any scaling a gate applied before it.
        q = self._gated("query", self.q_norm(q.view(b, t, self.n_heads, self.head_dim)), g)  # G4
        k = self._gated("key", self.k_norm(k.view(b, t, self.n_kv_heads, self.head_dim)), g)  # G3
        v = self._gated("value", v.view(b, t, self.n_kv_heads, self.head_dim), g)  # G2
        q, k = rope(q, offset), rope(k, offset)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))  # (B, heads, T, D)
        if cache is not None:
            k, v = cache.extend(layer, k, v)
        if self.keep_attention:
            y = self._explicit_attention(q, k, v)
        elif offset == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:  # new queries at offset.. see every cached key and the new ones up to themselves
            keys = torch.arange(k.shape[2], device=x.device)
            mask = keys[None, :] <= offset + torch.arange(t, device=x.device)[:, None]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        y = self._gated("sdpa", y.transpose(1, 2), g)  # G1: (B, T, H, D)
        out = self.o_proj(y.reshape(b, t, -1))
        if self.gate_position == "dense":  # G5 after W_O, before the residual add
            out = self.gate(out.view(b, t, self.gate.heads, self.gate.dim), g).view(b, t, -1)
        return out

    def _explicit_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Softmax attention; the probabilities on key 0 go to ``last_attention`` (probe mode only)."""
        groups = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        t = q.shape[2]
        logits = (q @ k.transpose(-1, -2)) * self.head_dim**-0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        probs = logits.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        self.last_attention = probs[..., :1].detach()
        return probs @ v


class SwiGLU(nn.Module):
    """SwiGLU FFN: ``W_down(silu(x W_gate) * x W_up)``, gate and up fused in one matmul."""

    def __init__(self, d_model: int, ffn_dim: int) -> None:
        super().__init__()
        self.ffn_dim = ffn_dim
        self.gate_up = nn.Linear(d_model, 2 * ffn_dim, bias=False)
        self.down = nn.Linear(ffn_dim, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, T, d)."""
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))`` then ``x + ffn(norm(x))``.

    The FFN is a SwiGLU, or a :class:`~experiments.moe.MoEFFN` when ``cfg.moe`` is set. With
    ``cfg.sandwich_norm`` each sub-layer's output is RMSNormed again before the residual add,
    ``x + norm(attn(norm(x)))`` (the "sandwich norm" of Table 2 row 7).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        if cfg.moe is None:
            self.ffn: nn.Module = SwiGLU(cfg.d_model, cfg.effective_ffn_dim())
        else:
            m = cfg.moe
            self.ffn = MoEFFN(cfg.d_model, m.n_experts, m.top_k, m.expert_dim, m.global_batch)
        post = (lambda: nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)) if cfg.sandwich_norm else nn.Identity
        self.attn_post_norm, self.ffn_post_norm = post(), post()

    def forward(
        self, x: torch.Tensor, rope: RotaryEmbedding, cache: KVCache | None = None, layer: int = 0
    ) -> torch.Tensor:
        """(B, T, d) residual stream in and out."""
        x = x + self.attn_post_norm(self.attn(self.attn_norm(x), rope, cache, layer))
        return x + self.ffn_post_norm(self.ffn(self.ffn_norm(x)))


class GatedLM(nn.Module):
    """The language model. ``forward(tokens (B, T) int64) -> logits (B, T, V)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        #: Probe mode: ``forward`` keeps each block's residual-stream output here.
        self.keep_hidden = False
        self.hidden_states: list[torch.Tensor] = []
        self.apply(self._init_weights)
        if cfg.tie_embeddings and cfg.linear_init_std() != cfg.init_std:
            # apply() drew the tied LM head last, at the linear std: the embedding's std wins (only
            # here, so models without the width-aware init draw exactly what they always drew)
            nn.init.normal_(self.embed.weight, mean=0.0, std=cfg.init_std)

    @property
    def max_seq_len(self) -> int:
        """The longest sequence ``forward`` takes: the RoPE table's length (``cfg.max_seq_len``
        unless :meth:`set_rope` changed it)."""
        return self.rope.cos.shape[0]

    def set_rope(
        self, theta: float | None = None, max_seq_len: int | None = None, yarn: YarnScaling | None = None
    ) -> None:
        """Rebuild the RoPE tables on the model's device, for inference at other lengths: no
        parameter changes, the state_dict keys stay (the tables are not saved). With no arguments,
        restores the config's RoPE.

        Table 5 of Qiu et al. evaluates past the training context with YaRN (Peng et al. 2023).

        Args:
            theta: RoPE base; default ``cfg.rope_theta``.
            max_seq_len: positions the tables cover, tokens; default ``cfg.max_seq_len``.
            yarn: YaRN scaling of the frequencies and attention temperature; None: plain RoPE.

        Raises:
            ValueError: ``theta <= 1`` or ``max_seq_len < 1``.
        """
        theta = self.cfg.rope_theta if theta is None else theta
        max_seq_len = self.cfg.max_seq_len if max_seq_len is None else max_seq_len
        if not theta > 1 or max_seq_len < 1:
            raise ValueError(f"set_rope needs theta > 1 and max_seq_len >= 1, got {theta} and {max_seq_len}")
        device = self.embed.weight.device
        self.rope = RotaryEmbedding(self.cfg.head_dim, max_seq_len, theta, yarn).to(device)

    def _init_weights(self, module: nn.Module) -> None:
        # Qwen3 init: N(0, initializer_range) for every linear and embedding; gate rows included.
        # The width-aware option widens the linear weights only (ModelConfig.linear_init_std).
        std = self.cfg.linear_init_std()
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=self.cfg.init_std)
        elif isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, MoEFFN):  # its experts are stacked matrices, not nn.Linear
            nn.init.normal_(module.w_gate_up, mean=0.0, std=std)
            nn.init.normal_(module.w_down, mean=0.0, std=std)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, head: bool = True) -> torch.Tensor:
        """(B, T) token ids -> (B, T, V) next-token logits. With a :class:`KVCache`, the tokens
        continue the sequences it holds (generation feeds the prompt, then one token at a time).
        ``head=False``: the (B, T, d) final norm's output, for a loss that applies ``lm_head``
        itself (``experiments.loss``, a chunk of tokens at a time).

        Raises:
            ValueError: the sequence (cached positions included) exceeds :attr:`max_seq_len`.
        """
        offset = cache.length if cache is not None else 0
        if offset + tokens.shape[1] > self.max_seq_len:
            raise ValueError(
                f"sequence of {offset + tokens.shape[1]} tokens exceeds max_seq_len={self.max_seq_len}"
            )
        x = self.embed(tokens)
        self.hidden_states = []
        for layer, block in enumerate(self.blocks):
            x = block(x, self.rope, cache, layer)
            if self.keep_hidden:
                self.hidden_states.append(x.detach())
        if cache is not None:
            cache.length += tokens.shape[1]
        return self.lm_head(self.norm(x)) if head else self.norm(x)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def count_active_parameters(model: nn.Module) -> int:
    """Parameters one token uses: all of them but the ``n_experts - top_k`` unchosen experts of
    each MoE layer. Embedding and LM head count, as in Qwen's published counts (Qwen3-30B-A3B:
    30.5B total, 3.3B activated; ``tests/test_model.py``). Equals the total for a dense model."""
    inactive = sum(m.inactive_parameters() for m in model.modules() if isinstance(m, MoEFFN))
    return count_parameters(model) - inactive
