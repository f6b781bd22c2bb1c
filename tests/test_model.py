"""Every gate of Tables 1, 3 and 4: shapes, parameter counts, baseline equivalence, causality."""

from __future__ import annotations

import dataclasses
from typing import get_args

import pytest
import torch

from experiments.config import ConfigError, GateConfig, ModelConfig, MoEConfig
from experiments.gating import ACTIVATIONS
from experiments.model import GatedLM, count_active_parameters, count_parameters
from experiments.model_config import Activation
from sweep.grid import load_grid
from tests.support import ROOT

# A small shape with GQA (q=4, k=2) and head_dim != d_model / n_heads.
SMALL = ModelConfig(
    vocab_size=64, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=6, ffn_dim=40, max_seq_len=16
)
D, Q, K, DK, L = 24, 4, 2, 6, 2

# name -> (gate, parameters it adds per layer, counted by hand from the paper's formulas, Section 2.1)
VARIANTS = {
    "sdpa_elementwise": (GateConfig(position="sdpa"), D * Q * DK),
    "value_elementwise": (GateConfig(position="value"), D * K * DK),
    "key_elementwise": (GateConfig(position="key"), D * K * DK),
    "query_elementwise": (GateConfig(position="query"), D * Q * DK),
    "dense_output": (GateConfig(position="dense"), D * D),
    "sdpa_headwise": (GateConfig(position="sdpa", granularity="headwise"), D * Q),
    "value_headwise": (GateConfig(position="value", granularity="headwise"), D * K),
    "sdpa_head_shared": (GateConfig(position="sdpa", sharing="head_shared"), D * Q * DK),
    "value_head_shared": (GateConfig(position="value", sharing="head_shared"), D * K * DK),
    "sdpa_additive_silu": (GateConfig(position="sdpa", combine="additive", activation="silu"), D * Q * DK),
    "sdpa_elementwise_silu": (GateConfig(position="sdpa", activation="silu"), D * Q * DK),
    "sdpa_additive_identity": (
        GateConfig(position="sdpa", combine="additive", activation="identity"),
        D * Q * DK,
    ),
    "sdpa_ns_sigmoid": (GateConfig(position="sdpa", activation="ns_sigmoid"), D * Q * DK),
    "sdpa_input_independent": (GateConfig(position="sdpa", input_dependent=False), Q * DK),
    "sdpa_rmsnorm": (GateConfig(position="sdpa", kind="rmsnorm"), Q * DK),
    "sdpa_silu": (GateConfig(position="sdpa", kind="silu"), 0),
}


def build(gate: GateConfig | None, seed: int = 0, **overrides) -> GatedLM:
    torch.manual_seed(seed)
    return GatedLM(dataclasses.replace(SMALL, gate=gate, **overrides)).double().eval()


@pytest.mark.parametrize("name", VARIANTS)
def test_shape_and_parameter_count(name: str) -> None:
    gate, per_layer = VARIANTS[name]
    model = build(gate)
    tokens = torch.randint(0, 64, (3, 11))
    assert model(tokens).shape == (3, 11, 64)
    assert count_parameters(model) - count_parameters(build(None)) == L * per_layer
    assert model.cfg.param_counts()[0] == count_parameters(model)  # the meta-device count agrees


def _copy_baseline_into(gated: GatedLM, base: GatedLM) -> None:
    """Give ``gated`` the baseline's weights; its gate columns sit after q|k|v in ``in_proj``."""
    gated_params = dict(gated.named_parameters())
    with torch.no_grad():
        for name, p in base.named_parameters():
            gated_params[name][: p.shape[0]].copy_(p)


@pytest.mark.parametrize("name", VARIANTS)
def test_gate_forced_to_identity_reproduces_baseline(name: str) -> None:
    gate, _ = VARIANTS[name]
    if gate.kind != "gate":
        pytest.skip("the Table 3 controls are transforms, not gates: nothing to force")
    base, gated = build(None), build(gate, seed=1)
    _copy_baseline_into(gated, base)
    neutral = 1.0 if gate.combine == "multiplicative" else 0.0
    for block in gated.blocks:
        block.attn.gate.activation = lambda z, v=neutral: torch.full_like(z, v)
    tokens = torch.randint(0, 64, (2, 13))
    torch.testing.assert_close(gated(tokens), base(tokens), rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", [None, *VARIANTS])
def test_causal(name: str | None) -> None:
    model = build(VARIANTS[name][0] if name else None)
    tokens = torch.randint(0, 64, (2, 12))
    changed = tokens.clone()
    changed[:, 7:] = (changed[:, 7:] + 1) % 64
    a, b = model(tokens), model(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-12)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


def _recorded_scores(model: GatedLM, tokens: torch.Tensor) -> torch.Tensor:
    gate = model.blocks[0].attn.gate
    gate.record = True
    model(tokens)
    return gate.recorded_scores


def test_sdpa_gate_depends_on_its_input() -> None:
    model = build(GateConfig(position="sdpa"))
    a = _recorded_scores(model, torch.tensor([[1, 2, 3, 4]]))
    b = _recorded_scores(model, torch.tensor([[5, 6, 7, 8]]))
    assert a.shape == (1, 4, Q, DK)
    assert (a - b).abs().max() > 1e-3
    assert (a[0, 0] - a[0, 1]).abs().max() > 1e-3  # and differs across positions of one sequence


def test_input_independent_gate_does_not() -> None:
    model = build(GateConfig(position="sdpa", input_dependent=False))
    a = _recorded_scores(model, torch.tensor([[1, 2, 3, 4]]))
    b = _recorded_scores(model, torch.tensor([[5, 6, 7, 8]]))
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(a, torch.full_like(a, 0.5), rtol=0, atol=0)  # zero init -> sigmoid(0)


def test_head_shared_scores_equal_across_heads() -> None:
    model = build(GateConfig(position="sdpa", sharing="head_shared"))
    scores = _recorded_scores(model, torch.tensor([[3, 1, 4, 1, 5]]))
    assert scores.shape == (1, 5, 1, DK)  # one n x d_k score broadcast over the q heads


def test_ns_sigmoid_range() -> None:
    model = build(GateConfig(position="sdpa", activation="ns_sigmoid"))
    scores = _recorded_scores(model, torch.randint(0, 64, (2, 9)))
    assert scores.min() >= 0.5 and scores.max() <= 1.0


def test_g1_gate_is_fused_into_the_qkv_projection() -> None:
    model = build(GateConfig(position="sdpa"))
    attn = model.blocks[0].attn
    assert attn.in_proj.weight.shape == (Q * DK + 2 * K * DK + Q * DK, D)  # one matmul: q | k | v | gate
    assert not any(isinstance(m, torch.nn.Linear) for m in attn.gate.modules())


def test_released_1b_parameter_counts() -> None:
    """The three released 1B checkpoints (paper.md §1.5), including match_params 6144 -> 5504."""
    shape = dict(
        vocab_size=152064,
        d_model=2048,
        n_layers=28,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=6144,
        tie_embeddings=True,
        max_seq_len=4096,
    )
    elementwise = ModelConfig(**shape, gate=GateConfig(), match_params=True)
    headwise = ModelConfig(**shape, gate=GateConfig(granularity="headwise"), match_params=True)
    assert ModelConfig(**shape).param_counts()[0] == 1_720_837_120
    assert elementwise.effective_ffn_dim() == 5504
    assert elementwise.param_counts()[0] == 1_728_177_152
    assert headwise.effective_ffn_dim() == 6144
    assert headwise.param_counts()[0] == 1_721_754_624


def test_more_query_heads_grow_wq_and_wo() -> None:
    grown = dataclasses.replace(SMALL, n_heads=6)
    assert grown.param_counts()[0] - SMALL.param_counts()[0] == L * 2 * D * 2 * DK


@pytest.mark.parametrize(
    ("kwargs", "path"),
    [
        (dict(n_kv_heads=3), "n_kv_heads"),
        (dict(head_dim=5), "head_dim"),
        (dict(d_model=0), "d_model"),
        (
            dict(gate=GateConfig(position="dense"), match_params=True, ffn_dim=8, ffn_multiple_of=1),
            "match_params",
        ),
    ],
)
def test_impossible_shapes_are_rejected(kwargs: dict, path: str) -> None:
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(SMALL, **kwargs)
    assert err.value.path == path


def test_bad_gate_combinations_are_rejected() -> None:
    with pytest.raises(ConfigError, match="G5"):
        GateConfig(position="dense", sharing="head_shared")
    with pytest.raises(ConfigError, match="SDPA output"):
        GateConfig(position="value", kind="rmsnorm")
    with pytest.raises(ConfigError, match="allowed: sdpa, value, key, query, dense"):
        GateConfig(position="output")


def _pattern(heads: int, width: int, vary_heads: bool = True) -> torch.Tensor:
    """Distinct constant scores in (0.3, 0.9): (heads, width), optionally the same for every head."""
    c = torch.linspace(0.3, 0.9, heads * width, dtype=torch.float64).view(heads, width)
    return c if vary_heads else c[:1].expand(heads, width)


@pytest.mark.parametrize("position", ["sdpa", "value", "key", "query", "dense"])
def test_gate_acts_at_its_position(position: str) -> None:
    """Constant scores c at a position equal the baseline with the matching weights scaled by c.

    G1 scales W_O's input columns, G2 the v rows of the fused projection, G3 / G4 the qk-norm
    gains (the gate acts after qk-norm, before RoPE), G5 W_O's output rows.
    """
    base, gated = build(None), build(GateConfig(position=position), seed=1)
    _copy_baseline_into(gated, base)
    heads, dim = {"sdpa": (Q, DK), "value": (K, DK), "key": (K, DK), "query": (Q, DK), "dense": (1, D)}[
        position
    ]
    c = _pattern(heads, dim, vary_heads=position not in ("key", "query"))
    q_dim, kv_dim = Q * DK, K * DK
    with torch.no_grad():
        for gated_block, block in zip(gated.blocks, base.blocks):
            gated_block.attn.gate.activation = lambda z: c.expand_as(z)
            attn = block.attn
            if position == "sdpa":
                attn.o_proj.weight.mul_(c.reshape(1, -1))
            elif position == "value":
                attn.in_proj.weight[q_dim + kv_dim : q_dim + 2 * kv_dim].mul_(c.reshape(-1, 1))
            elif position == "key":
                attn.k_norm.weight.mul_(c[0])
            elif position == "query":
                attn.q_norm.weight.mul_(c[0])
            else:
                attn.o_proj.weight.mul_(c.reshape(-1, 1))
    tokens = torch.randint(0, 64, (2, 10))
    torch.testing.assert_close(gated(tokens), base(tokens), rtol=0, atol=1e-10)


def test_head_shared_score_is_the_mean_over_heads() -> None:
    model = build(GateConfig(position="sdpa", sharing="head_shared"))
    tokens = torch.randint(0, 64, (2, 7))
    recorded = _recorded_scores(model, tokens)
    block = model.blocks[0]
    x = block.attn_norm(model.embed(tokens))
    logits = x @ block.attn.in_proj.weight[-Q * DK :].T  # the gate's columns of the fused projection
    expected = torch.sigmoid(logits.view(2, 7, Q, DK)).mean(dim=2, keepdim=True)
    torch.testing.assert_close(recorded, expected, rtol=0, atol=1e-12)


MOE = MoEConfig(n_experts=8, top_k=2, expert_dim=6)


def test_active_parameters_match_qwens_published_counts() -> None:
    """Qwen3-30B-A3B is the 15A2B shape with 48 layers; Qwen publishes 30.5B total, 3.3B
    activated. The same counter gives Table 7's 15A2B (24 layers) 15.58B / 1.99B."""
    qwen3 = ModelConfig(
        vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
        max_seq_len=4096, moe=MoEConfig(n_experts=128, top_k=8, expert_dim=768),
    )  # fmt: skip
    total, active = qwen3.param_counts()
    assert round(total / 1e9, 1) == 30.5
    assert 3.3e9 <= active < 3.4e9  # 3.35B, published as "3.3B"
    half = dataclasses.replace(qwen3, n_layers=24).param_counts()
    assert (round(half[0] / 1e9, 2), round(half[1] / 1e9, 2)) == (15.58, 1.99)


def test_dense_active_equals_total_and_moe_counts_only_chosen_experts() -> None:
    total, active = SMALL.param_counts()
    assert total == active == count_parameters(build(None))
    model = build(None, moe=MOE)
    total, active = count_parameters(model), count_active_parameters(model)
    assert total - active == L * (8 - 2) * 3 * D * 6
    router = D * 8
    expected_ffn = router + 8 * 3 * D * 6
    assert total - count_parameters(build(None)) == L * (expected_ffn - 3 * D * 40)  # MoE for SwiGLU
    assert model.cfg.param_counts() == (total, active)


def test_moe_language_model_trains_every_routed_expert() -> None:
    model = build(None, moe=MOE).train()
    tokens = torch.randint(0, 64, (4, 12))
    logits = model(tokens)
    assert logits.shape == (4, 12, 64)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    for block in model.blocks:
        used = block.ffn.stats.load > 0
        grads = block.ffn.w_gate_up.grad.flatten(1).abs().sum(-1)
        assert (grads[used] > 0).all() and (grads[~used] == 0).all()
        assert block.ffn.router.weight.grad.abs().sum() > 0  # through the renormalised weights


def test_sandwich_norm_normalises_each_sublayer_output() -> None:
    """Table 2 row 7: ``x + norm(attn(norm(x)))``; two RMSNorm gains more per layer."""
    plain, sandwich = build(None, seed=3), build(None, seed=3, sandwich_norm=True)
    assert count_parameters(sandwich) - count_parameters(plain) == L * 2 * D
    block = sandwich.blocks[0]
    x = torch.randn(2, 5, D, dtype=torch.float64)
    with torch.no_grad():
        block.attn_post_norm.weight.fill_(0.5)
        after_attn = x + block.attn_post_norm(block.attn(block.attn_norm(x), sandwich.rope))
        expected = after_attn + block.ffn_post_norm(block.ffn(block.ffn_norm(after_attn)))
        attn_out = block.attn(block.attn_norm(x), sandwich.rope)
        rms = attn_out.pow(2).mean(-1, keepdim=True).add(SMALL.norm_eps).rsqrt()
        assert torch.allclose(after_attn - x, 0.5 * attn_out * rms)  # RMSNorm by hand, gain 0.5
        assert torch.allclose(block(x, sandwich.rope), expected)
    assert not isinstance(plain.blocks[0].attn_post_norm, torch.nn.RMSNorm)


def test_match_params_is_rejected_for_a_moe_model() -> None:
    with pytest.raises(ConfigError, match="match_params"):
        dataclasses.replace(SMALL, gate=GateConfig(), match_params=True, moe=MOE)


def test_the_benchmarks_dense_twin_has_the_moe_models_active_parameters() -> None:
    from tools.throughput.bare import dense_twin

    moe = dataclasses.replace(SMALL, moe=MOE)
    twin = dense_twin(moe)
    assert twin.moe is None and twin.ffn_dim == 2 * 6
    assert moe.param_counts()[1] - twin.param_counts()[0] == L * D * 8  # the router alone


def built_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active) of the model actually built, on the meta device (no memory)."""
    with torch.device("meta"):
        model = GatedLM(cfg)
    return count_parameters(model), count_active_parameters(model)


@pytest.mark.parametrize("grid", sorted((ROOT / "grids").glob("*.yaml")), ids=lambda p: p.name)
def test_counted_parameters_equal_the_built_models_for_every_shipped_cell(grid) -> None:
    """``ModelConfig.param_counts`` counts from the shape alone; the built model must agree for
    every row of every grid at every scale (MoE, sandwich norm, tied embeddings, every gate)."""
    g = load_grid(grid)
    for scale in g.scales:
        for cell in g.cells(scale, seeds=[0]):
            assert cell.config.model.param_counts() == built_counts(cell.config.model), (scale, cell.row.id)


@pytest.mark.parametrize("name", VARIANTS)
def test_counted_parameters_equal_the_built_models_for_every_variant(name: str) -> None:
    gate, _ = VARIANTS[name]
    for cfg in (
        dataclasses.replace(SMALL, gate=gate),
        dataclasses.replace(
            SMALL, gate=gate, moe=MOE, qk_norm=False, sandwich_norm=True, tie_embeddings=True
        ),
    ):
        assert cfg.param_counts() == built_counts(cfg)


# Each gate activation and what it computes, by hand. A new activation is one entry here, one name in
# ``experiments.model_config.Activation`` and one function in ``experiments.gating.ACTIVATIONS``.
ACTIVATION_VALUES = {
    "sigmoid": lambda z: 1 / (1 + torch.exp(-z)),
    "silu": lambda z: z / (1 + torch.exp(-z)),
    "ns_sigmoid": lambda z: 0.5 + 0.5 / (1 + torch.exp(-z)),
    "identity": lambda z: z,
}


def test_the_configs_activations_are_the_gating_modules() -> None:
    assert set(get_args(Activation)) == set(ACTIVATIONS) == set(ACTIVATION_VALUES)


@pytest.mark.parametrize("name", sorted(ACTIVATION_VALUES))
def test_each_activation_computes_its_formula_and_trains(name: str) -> None:
    z = torch.linspace(-4, 4, 17, dtype=torch.float64)
    torch.testing.assert_close(ACTIVATIONS[name](z), ACTIVATION_VALUES[name](z))
    model = build(GateConfig(position="sdpa", activation=name)).train()
    model(torch.randint(0, 64, (2, 9))).sum().backward()
    gate_rows = model.blocks[0].attn.in_proj.weight.grad[-Q * DK :]  # the gate's slice of q|k|v|gate
    assert gate_rows.abs().sum() > 0


@pytest.mark.parametrize("name", [None, *VARIANTS, "moe"])
def test_feeding_tokens_through_the_kv_cache_equals_one_forward(name: str | None) -> None:
    """Prompt, then one token at a time, then two: the logits of a full forward, every gate and
    the MoE; dropping a row of the batch keeps the others' cache."""
    from experiments.model import KVCache

    gate = VARIANTS[name][0] if name in VARIANTS else None
    model = build(gate, moe=MOE) if name == "moe" else build(gate)
    tokens = torch.randint(0, 64, (3, 10))
    full = model(tokens)
    cache = KVCache(L)
    parts = [model(tokens[:, :5], cache), model(tokens[:, 5:6], cache), model(tokens[:, 6:7], cache)]
    cache.keep(torch.tensor([0, 2]))
    parts.append(model(tokens[[0, 2], 7:10], cache))
    torch.testing.assert_close(torch.cat(parts[:3], dim=1), full[:, :7], rtol=0, atol=1e-10)
    torch.testing.assert_close(parts[3], full[[0, 2], 7:10], rtol=0, atol=1e-10)
    assert cache.length == 10
    with pytest.raises(ValueError, match="exceeds max_seq_len=16"):
        model(torch.randint(0, 64, (2, 7)), cache)
