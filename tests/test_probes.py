"""Each probe recomputed by hand on a constructed model or tensor (experiments/probes.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np
import pytest
import torch

from experiments.config import DataConfig, GateConfig, ModelConfig
from experiments.corpus import build_corpus
from experiments.model import GatedLM
from experiments.probes import first_token_attention, probe_batch, run_probes, score_summary
from tests.support import ROOT

SHAPE = ModelConfig(
    vocab_size=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=32, max_seq_len=16
)
T = 12


def build(gate: GateConfig | None = None) -> GatedLM:
    torch.manual_seed(0)
    return GatedLM(dataclasses.replace(SHAPE, gate=gate))


def tokens(n: int = 3) -> torch.Tensor:
    return torch.arange(n * T).reshape(n, T) % 60 + 1


def test_first_token_attention_of_a_constructed_pattern() -> None:
    probs = torch.zeros(2, 3, 4, 4)
    probs[..., 0, 0] = 1.0  # query 0 can only attend to itself
    probs[..., 1:, 0] = 0.25
    probs[..., 1:, 1] = 0.75
    probs[:, 2] = torch.eye(4)  # head 2 attends to itself only: mass 1/4 on key 0 (from query 0)
    assert first_token_attention(probs).tolist() == pytest.approx([(1 + 3 * 0.25) / 4] * 2 + [0.25])


def test_uniform_causal_attention_gives_the_harmonic_f_attn() -> None:
    model = build()
    for block in model.blocks:  # q = 0: every logit 0, so query t spreads 1 / (t + 1) over its prefix
        q_rows = block.attn.split_sizes[0]
        block.attn.in_proj.weight.data[:q_rows] = 0.0
    result = run_probes(model, tokens(), chunk=2)
    expected = sum(1 / (t + 1) for t in range(T)) / T
    assert result.layers["f_attn"] == pytest.approx([expected] * 2)
    assert result.summary["sink/first_token_attn"] == pytest.approx(expected)
    assert np.allclose(result.heads["f_attn"], expected)


def test_planted_residual_value_gives_that_m_act() -> None:
    model = build()
    for block in model.blocks:  # blocks become the identity on the residual stream
        block.attn.o_proj.weight.data.zero_()
        block.ffn.down.weight.data.zero_()
    model.embed.weight.data[7, 3] = -321.0
    result = run_probes(model, torch.tensor([[1, 7, 2, 3]]))
    assert result.layers["m_act"] == [321.0, 321.0]
    assert result.summary["act/max_mean"] == 321.0 and result.summary["act/max_max"] == 321.0


def _static_gate(values: np.ndarray, **gate: object) -> GatedLM:
    """A model whose G1 scores are ``values`` (H, W) at every token: an input-independent gate."""
    model = build(GateConfig(position="sdpa", input_dependent=False, **gate))
    logits = torch.logit(torch.tensor(values, dtype=torch.float32))
    for block in model.blocks:
        block.attn.gate.static_logits.data.copy_(logits)
    return model


def test_gate_scores_forced_to_known_values() -> None:
    # 32 scores per token (4 heads x 8 channels), a quarter each at 0.05, 0.2, 0.6 and 0.9.
    values = np.repeat([0.05, 0.2, 0.6, 0.9], 8).reshape(4, 8)
    result = run_probes(_static_gate(values), tokens(), chunk=2)
    s = result.summary
    assert s["gate/score_mean"] == pytest.approx((0.05 + 0.2 + 0.6 + 0.9) / 4)
    assert s["gate/frac_below_0.1"] == pytest.approx(0.25) and s["gate/frac_below_0.5"] == pytest.approx(0.5)
    assert (s["gate/score_q01"], s["gate/score_q10"]) == (pytest.approx(0.05), pytest.approx(0.05))
    assert s["gate/score_q50"] == pytest.approx(0.4)  # even count: halfway between 0.2 and 0.6
    assert (s["gate/score_q90"], s["gate/score_q99"]) == (pytest.approx(0.9), pytest.approx(0.9))
    assert result.heads["gate_score"][0] == pytest.approx([0.05, 0.2, 0.6, 0.9])  # one score per head
    assert result.gate_hist.sum() == 2 * 3 * T * 32  # layers x sequences x tokens x scores
    assert result.metrics()["gate/score_mean.layer_01"] == pytest.approx(0.4375)


def test_two_valued_gate_control_differs_from_the_real_sparsity() -> None:
    # Channels alternate between scores 0.02 and 0.98 (mean 0.5). The real gated output is
    # pre * s, the paper's control pre * 0.5: recomputed here from the captured pre-gate output.
    values = np.tile([0.02, 0.98], (4, 4))
    model = _static_gate(values)
    pre: list[torch.Tensor] = []
    hook = model.blocks[0].attn.gate.register_forward_pre_hook(lambda m, args: pre.append(args[0]))
    x = tokens()
    result = run_probes(model, x, chunk=len(x))
    hook.remove()
    y = pre[0]  # (B, T, H, D), layer 0, from the first of the two passes
    scores = torch.tensor(values, dtype=torch.float32)
    for t in (1e-2, 1e-3):
        real = float(((y * scores).abs() < t).double().mean())
        control = float(((y * 0.5).abs() < t).double().mean())
        assert result.layers[f"sdpa_below_{t:g}"][0] == pytest.approx(real)
        assert result.layers[f"control_below_{t:g}"][0] == pytest.approx(control)
    assert result.layers["sdpa_below_0.01"][0] > result.layers["control_below_0.01"][0]  # gating is sparser


def test_additive_gates_get_no_gate_score() -> None:
    gate = GateConfig(position="sdpa", combine="additive", activation="identity")
    result = run_probes(build(gate), tokens(1))
    assert not any(k.startswith("gate/") for k in result.summary) and result.gate_hist is None


def test_a_nan_residual_shows_as_a_nan_m_act() -> None:
    model = build()
    model.blocks[1].ffn.down.weight.data[0, 0] = float("nan")
    result = run_probes(model, tokens(2), chunk=1)
    assert not math.isnan(result.layers["m_act"][0]) and math.isnan(result.layers["m_act"][1])


def test_probe_mode_keeps_only_the_first_key_column() -> None:
    model = build()
    attn = model.blocks[0].attn
    attn.keep_attention = True
    model(tokens(2))
    assert attn.last_attention.shape == (2, SHAPE.n_heads, T, 1)


def test_constant_gate_sparsity_equals_its_control() -> None:
    # Every score 0.3: the gated output is exactly the pre-gate output times the mean score, so
    # the paper's control (Figure 5) and the real sparsity must agree, and |Y| shrinks by 0.3.
    result = run_probes(_static_gate(np.full((4, 8), 0.3)), tokens())
    s = result.summary
    for t in ("0.01", "0.001"):
        assert s[f"sparsity/sdpa_below_{t}"] == pytest.approx(s[f"sparsity/control_below_{t}"])
    assert s["act/sdpa_abs_mean_post"] == pytest.approx(0.3 * s["act/sdpa_abs_mean_pre"], rel=1e-5)
    assert s["sparsity/sdpa_below_0.01"] >= s["sparsity/sdpa_below_0.001"]


def test_score_summary_of_a_small_array() -> None:
    out = score_summary(np.array([0.0, 0.25, 0.5, 1.0]))
    assert out["score_mean"] == 0.4375 and out["score_q50"] == 0.375
    assert out["frac_below_0.1"] == 0.25 and out["frac_below_0.5"] == 0.5


def test_baseline_has_no_gate_metrics_and_probing_leaves_the_model_unchanged() -> None:
    model = build()
    model.train()
    x = tokens()
    before = model(x).detach()
    result = run_probes(model, x)
    assert not any(k.startswith("gate/") for k in result.summary)
    assert result.summary["act/sdpa_abs_mean_pre"] == result.summary["act/sdpa_abs_mean_post"]
    assert model.training and not model.keep_hidden and not model.blocks[0].attn.keep_attention
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)


def test_probe_metric_keys_are_bounded() -> None:
    result = run_probes(build(GateConfig(position="sdpa")), tokens(1))
    per_layer = [k for k in result.metrics() if ".layer_" in k]
    assert len(per_layer) == 6 * SHAPE.n_layers  # gate score, F-Attn, late F-Attn, M-Act, |Y| pre, post
    assert len(result.metrics()) < 40


def test_probe_batch_is_fixed_recorded_and_writes_nothing_into_the_corpus() -> None:
    corpus = build_corpus(DataConfig(vocab_size=512, max_chars_per_source=200000), ROOT / ".cache")
    before = sorted(p.name for p in corpus.root.rglob("*"))
    a, record = probe_batch(corpus, seq_len=32, per_domain=2)
    b, again = probe_batch(corpus, seq_len=32, per_domain=2)
    assert a.shape == (2 * len(corpus.domains), 32) and torch.equal(a, b) and record == again
    first = corpus.domains[0]
    assert a[0].tolist() == corpus.tokens("test", first)[:32].tolist()
    assert record["domains"][first] == {"windows": 2, "first_token": 0}
    assert record["sha256"] == hashlib.sha256(a.numpy().tobytes()).hexdigest()
    assert sorted(p.name for p in corpus.root.rglob("*")) == before  # nothing written into it
