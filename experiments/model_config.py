"""The model's configuration: its shape (:class:`ModelConfig`, Table 7), the attention gate
(:class:`GateConfig`, the paper's gate space of Section 2.1) and the mixture of experts
(:class:`MoEConfig`, Section 2.2), with the analytic parameter counts of each
(:meth:`ModelConfig.param_counts`), so no model is built to know them.

Every dataclass validates itself in ``__post_init__`` and raises :class:`ConfigError` with the
offending field's key. ``experiments.config`` re-exports every name here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from experiments.strict import ConfigError, check_literals

PAPER_WIDTH = 2048
"""The paper's ``d_model`` (Table 7, 15A2B and 1.7B): the reference of the width-aware init."""


GatePosition = Literal["sdpa", "value", "key", "query", "dense"]
GateKind = Literal["gate", "rmsnorm", "silu"]
Granularity = Literal["elementwise", "headwise"]
Sharing = Literal["head_specific", "head_shared"]
Combine = Literal["multiplicative", "additive"]
Activation = Literal["sigmoid", "silu", "ns_sigmoid", "identity"]


@dataclass(frozen=True)
class GateConfig:
    """One point of the paper's gating space (Section 2.1): ``Y' = g(Y, X, W, sigma)``.

    ``kind="gate"`` is the paper's gate. ``kind="rmsnorm"`` and ``kind="silu"`` are the two
    non-gate controls of Table 3 (rows 5 and 6): per-head RMSNorm on the SDPA output, and
    parameter-free SiLU on it; they only exist at position ``sdpa``.

    The dense-output gate (G5, Table 1 row 9) multiplies ``W_O``'s output, before the residual
    add, by act(X W) with X the pre-normed hidden state, as every other gate: an ``n x d_model``
    score. Headwise, it has one score per group of ``d_model / n_heads`` consecutive output
    channels (n x q scores, ``d * q`` parameters a layer, as G1 headwise): ``W_O`` mixes the
    heads, so the groups are not heads. A scalar per head on each head's own term ``y_h W_O^h``
    is G1 headwise exactly (a scalar commutes with ``W_O^h``), so it is no G5 variant.

    The input-independent gate (``input_dependent: false``, Table 4 row 6) learns one logit per
    score, the same for every token, from ``static_init``: with ``activation: identity`` and
    ``static_init: 0.5`` it is a LayerScale (Touvron et al. 2021, "Going deeper with image
    transformers", Section 3) starting at a sigmoid gate's mean score at initialisation.
    """

    #: options added after runs were keyed: left out of run keys while at their default
    KEYED_WHEN_SET: ClassVar[tuple[str, ...]] = ("static_init",)

    position: GatePosition = "sdpa"
    """Where the gate acts: G1 ``sdpa`` output, G2 ``value``, G3 ``key``, G4 ``query``, G5 ``dense``."""
    kind: GateKind = "gate"
    """``gate`` (a learned score), or a Table 3 control: ``rmsnorm`` or ``silu`` on the SDPA output."""
    granularity: Granularity = "elementwise"
    """``elementwise``: one score per channel; ``headwise``: one scalar per head (G5: per group of
    ``d_model / n_heads`` output channels)."""
    sharing: Sharing = "head_specific"
    """``head_shared`` averages the scores over the heads (the paper's n x d_k score)."""
    combine: Combine = "multiplicative"
    """``multiplicative``: Y * act(XW); ``additive``: Y + act(XW)."""
    activation: Activation = "sigmoid"
    """``sigmoid``, ``silu``, ``ns_sigmoid`` (0.5 + 0.5 sigmoid, Table 4 row 7) or ``identity``."""
    input_dependent: bool = True
    """False: a learnable score, the same for every token (Table 4 row 6), its logits starting at
    ``static_init``."""
    static_init: float = 0.0
    """Initial value of every logit of an input-independent gate: 0 is Table 4 row 6's zero init
    (sigmoid(0) = 0.5); with ``activation: identity``, the starting scale of a LayerScale."""

    def __post_init__(self) -> None:
        check_literals(self)
        if not math.isfinite(self.static_init):
            raise ConfigError("static_init", f"must be a finite number, got {self.static_init}")
        if self.static_init != 0.0 and (self.kind != "gate" or self.input_dependent):
            raise ConfigError(
                "static_init", "sets the logits of an input-independent gate only (input_dependent: false)"
            )
        if self.kind != "gate":
            if self.position != "sdpa":
                raise ConfigError("position", f"kind '{self.kind}' acts on the SDPA output only; use 'sdpa'")
            return
        if self.position == "dense" and self.sharing != "head_specific":
            raise ConfigError(
                "sharing", "the dense-output gate (G5) has no per-head scores to share: use head_specific"
            )

    def heads_and_dim(self, model: ModelConfig) -> tuple[int, int]:
        """(H, D): the heads the gate acts on and the channels per head, by position (query heads
        for G1 / G4, KV heads for G2 / G3; for G5 one "head" of ``d_model`` elementwise, and
        ``n_heads`` groups of ``d_model / n_heads`` output channels headwise)."""
        if self.position in ("sdpa", "query"):
            return model.n_heads, model.head_dim
        if self.position in ("value", "key"):
            return model.n_kv_heads, model.head_dim
        if self.granularity == "headwise":
            return model.n_heads, model.d_model // model.n_heads
        return 1, model.d_model

    def score_width(self, model: ModelConfig) -> int:
        """Scores per token: H * W, with W = D elementwise, 1 headwise."""
        heads, dim = self.heads_and_dim(model)
        return heads * (dim if self.granularity == "elementwise" else 1)

    def projection_width(self, model: ModelConfig) -> int:
        """Output columns the gate adds to the fused q|k|v projection (0 without a projection:
        the input-independent gate and the Table 3 controls)."""
        if self.kind != "gate" or not self.input_dependent:
            return 0
        return self.score_width(model)

    def param_count(self, model: ModelConfig) -> int:
        """Parameters the gate adds per layer, e.g. ``d * q * d_k`` for G1 elementwise (Section 2.1);
        ``q * d_k`` learnable logits for the input-independent gate, one gain per channel for the
        group-norm control, none for plain SiLU."""
        if self.kind == "silu":
            return 0
        if self.kind == "rmsnorm":
            heads, dim = self.heads_and_dim(model)
            return heads * dim
        if not self.input_dependent:
            return self.score_width(model)
        return self.score_width(model) * model.d_model


@dataclass(frozen=True)
class MoEConfig:
    """Fine-grained mixture-of-experts FFN (Section 2.2, Table 7: 15A2B has 128 experts of width
    768, top-8 softmax routing, global-batch load balancing and z-loss)."""

    n_experts: int = 128
    """Routed experts per layer (E)."""
    top_k: int = 8
    """Experts each token is sent to (k); their renormalised router probabilities weight them."""
    expert_dim: int = 768
    """Hidden width of each SwiGLU expert (fine-grained: 768 = 0.375 d at 15A2B)."""
    lb_coef: float = 0.01
    """Weight of the load-balancing loss ``E * sum_e f_e P_e`` (mean over layers) in the training loss."""
    z_coef: float = 0.001
    """Weight of the router z-loss ``mean(logsumexp(logits)^2)`` (mean over layers)."""
    global_batch: bool = True
    """Balance over the global batch (counts all-reduced across data-parallel ranks), not per rank."""

    def __post_init__(self) -> None:
        for name in ("n_experts", "top_k", "expert_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)}")
        if self.top_k > self.n_experts:
            raise ConfigError("top_k", f"must not exceed n_experts={self.n_experts}, got {self.top_k}")
        for name in ("lb_coef", "z_coef"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be 0 or more, got {getattr(self, name)}")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only LM shape (Table 7): pre-RMSNorm, RoPE, GQA, optional qk-norm, SwiGLU FFN or
    a mixture of SwiGLU experts, optional sandwich norm."""

    vocab_size: int = 4096
    """Embedding rows; the tokenizer's vocabulary must fit in it."""
    d_model: int = 128
    """Residual-stream width (the paper's d, "Hidden")."""
    n_layers: int = 4
    """Number of decoder blocks (L)."""
    n_heads: int = 8
    """Query heads (q)."""
    n_kv_heads: int = 1
    """Key/value heads (k); must divide ``n_heads`` (GQA)."""
    head_dim: int = 32
    """Per-head width d_k, independent of ``d_model``."""
    ffn_dim: int = 384
    """SwiGLU hidden width before ``match_params`` (unused when ``moe`` is set)."""
    moe: MoEConfig | None = None
    """Replace every dense FFN by a mixture of experts; ``None`` is a dense model."""
    sandwich_norm: bool = False
    """Also RMSNorm the attention and FFN outputs before the residual add (Table 2 row 7)."""
    qk_norm: bool = True
    """RMSNorm over each query and key head before RoPE."""
    tie_embeddings: bool = False
    """Share the input embedding and the LM head."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    max_seq_len: int = 128
    """Longest sequence the RoPE cache covers (tokens)."""
    gate: GateConfig | None = None
    """The attention gate or Table 3 control; ``None`` is the baseline."""
    match_params: bool = False
    """Narrow the FFN so the gated model keeps the baseline's parameter count (released 1B: 6144 -> 5504)."""
    ffn_multiple_of: int = 128
    """``match_params`` removes FFN width in multiples of this (128 reproduces the released 5504)."""
    init_std: float = 0.02
    """Std of the normal init of every linear and embedding weight (Qwen3 ``initializer_range``)."""
    init_ref_width: int | None = None
    """Width-aware init: linear weights get ``init_std * sqrt(init_ref_width / d_model)``, so a
    pre-normed input's projections (gate logits ``XW``, q, k, v, expert inputs) have the spread
    they have at width ``init_ref_width`` (2048, the paper's); embeddings keep ``init_std``.
    ``None``: ``init_std`` everywhere, at any width. It changes nothing at ``d_model = init_ref_width``."""

    #: options added after runs were keyed: left out of run keys while at their default
    KEYED_WHEN_SET: ClassVar[tuple[str, ...]] = ("init_ref_width",)

    def linear_init_std(self) -> float:
        """Std of the normal init of the linear (and expert) weights: ``init_std``, times
        ``sqrt(init_ref_width / d_model)`` with the width-aware init."""
        if self.init_ref_width is None:
            return self.init_std
        return self.init_std * (self.init_ref_width / self.d_model) ** 0.5

    def __post_init__(self) -> None:
        check_literals(self)
        if self.init_ref_width is not None and self.init_ref_width <= 0:
            raise ConfigError("init_ref_width", f"must be positive, got {self.init_ref_width}")
        for name in (
            "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
            "max_seq_len", "norm_eps", "init_std",
        ):  # fmt: skip
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)}")
        if self.rope_theta <= 1:  # a base <= 1 makes every rotation frequency 1 or grow with the channel
            raise ConfigError("rope_theta", f"must exceed 1 (the RoPE base), got {self.rope_theta}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(
                "n_kv_heads", f"must divide n_heads={self.n_heads} (GQA), got {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError("head_dim", f"must be even for RoPE, got {self.head_dim}")
        if self.ffn_multiple_of <= 0:
            raise ConfigError("ffn_multiple_of", f"must be positive, got {self.ffn_multiple_of}")
        if self.match_params and self.moe is not None:
            raise ConfigError("match_params", "narrows the dense FFN; a MoE model (moe set) has none")
        gate = (self.gate.position, self.gate.granularity) if self.gate is not None else None
        if gate == ("dense", "headwise") and self.d_model % self.n_heads:
            raise ConfigError(
                "gate.granularity",
                f"a headwise G5 gate splits d_model={self.d_model} into n_heads={self.n_heads} equal groups; "
                "n_heads must divide d_model",
            )
        if self.match_params and self.effective_ffn_dim() <= 0:
            raise ConfigError("match_params", "the gate has more parameters than the whole FFN")

    def gate_params_per_layer(self) -> int:
        """Parameters the gate adds to one layer (0 for the baseline and the SiLU control)."""
        return 0 if self.gate is None else self.gate.param_count(self)

    def gate_projection_width(self) -> int:
        """Columns the gate adds to each layer's fused q|k|v projection (0 for the baseline)."""
        return 0 if self.gate is None else self.gate.projection_width(self)

    def param_counts(self) -> tuple[int, int]:
        """(total, active) parameters of ``GatedLM(self)``, counted from the shape alone.

        Active leaves out the ``n_experts - top_k`` experts a token does not use in each MoE
        layer; embeddings and LM head count, as in Qwen's published counts (Qwen3-30B-A3B: 30.5B
        total, 3.3B active). ``tests/test_model.py`` checks both against the built model.
        """
        d, q_dim, kv_dim = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attention = d * (q_dim + 2 * kv_dim) + q_dim * d + self.gate_params_per_layer()
        norms = 2 * d + (2 * self.head_dim if self.qk_norm else 0) + (2 * d if self.sandwich_norm else 0)
        if self.moe is None:
            ffn, inactive = 3 * d * self.effective_ffn_dim(), 0
        else:
            expert = 3 * d * self.moe.expert_dim
            ffn = d * self.moe.n_experts + self.moe.n_experts * expert  # router + experts
            inactive = (self.moe.n_experts - self.moe.top_k) * expert
        embeddings = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        total = embeddings + d + self.n_layers * (attention + norms + ffn)
        return total, total - self.n_layers * inactive

    def effective_ffn_dim(self) -> int:
        """FFN width after ``match_params``: the baseline width minus the gate's share, rounded.

        The removed width is ``round(G / (3 d) / m) * m`` with G the gate's parameters per layer,
        3 d the SwiGLU parameters per unit of width and m = ``ffn_multiple_of``.
        """
        if not self.match_params or self.gate is None:
            return self.ffn_dim
        per_unit = 3 * self.d_model
        removed = round(self.gate_params_per_layer() / per_unit / self.ffn_multiple_of) * self.ffn_multiple_of
        return self.ffn_dim - removed
