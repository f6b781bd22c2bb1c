"""The G5 control rows of issue 57 (grids/g5_controls.yaml): the input-independent G5 gate, the
LayerScale, the headwise G5 gate and G5's input; their parameter counts by hand, and run keys that
leave Table 1's cells where they are."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch

from experiments.config import ConfigError, GateConfig, ModelConfig, TrainConfig
from experiments.lit import adamw
from experiments.model import GatedLM, count_parameters
from experiments.strict import identity_dict
from sweep.grid import load_grid
from tests.support import ROOT

# A small shape with GQA (q=4, k=2); d_model = 24 splits into 4 groups of 6 channels for G5 headwise.
SMALL = ModelConfig(
    vocab_size=64, d_model=24, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=6, ffn_dim=40, max_seq_len=16
)
D, Q, K, DK, L = 24, 4, 2, 6, 2

G5 = GateConfig(position="dense")
G5_STATIC = GateConfig(position="dense", input_dependent=False)
LAYERSCALE = GateConfig(position="dense", input_dependent=False, activation="identity", static_init=0.5)
G5_HEADWISE = GateConfig(position="dense", granularity="headwise")

# gate -> parameters it adds per layer, counted by hand: G5's d x d projection, one logit per output
# channel for the input-independent gate and the LayerScale, d x q for one score per channel group
BY_HAND = {
    "g5": (G5, D * D),
    "static": (G5_STATIC, D),
    "layerscale": (LAYERSCALE, D),
    "headwise": (G5_HEADWISE, D * Q),
}


def build(gate: GateConfig | None, seed: int = 0) -> GatedLM:
    torch.manual_seed(seed)
    return GatedLM(dataclasses.replace(SMALL, gate=gate)).double().eval()


@pytest.mark.parametrize("name", BY_HAND)
def test_each_g5_control_adds_the_parameters_counted_by_hand(name: str) -> None:
    gate, per_layer = BY_HAND[name]
    model = build(gate)
    assert count_parameters(model) - count_parameters(build(None)) == L * per_layer
    assert model.cfg.param_counts()[0] == count_parameters(model)


def test_the_grids_new_rows_add_what_the_hand_count_says_at_tiny() -> None:
    """Tiny: d = 128, q = 16, 4 layers. One logit per channel: 4 x 128; headwise: 4 x 128 x 16, the
    same as G1 headwise; G5 elementwise 4 x 128 x 128."""
    grid = load_grid(ROOT / "grids/g5_controls.yaml")
    base = grid.baseline_config("tiny").model.param_counts()[0]
    added = {r.id: grid.resolve("tiny", r, 0).model.param_counts()[0] - base for r in grid.rows}
    assert added == {
        "baseline": 0,
        "sdpa_elementwise": 4 * 128 * 16 * 16,
        "sdpa_headwise": 4 * 128 * 16,
        "sdpa_input_independent": 4 * 16 * 16,
        "dense_output": 4 * 128 * 128,
        "dense_input_independent": 4 * 128,
        "dense_layerscale": 4 * 128,
        "dense_layerscale_one": 4 * 128,
        "dense_headwise": 4 * 128 * 16,
    }


def _attention_io(model: GatedLM, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Block 0's attention: its input X (after the pre-attention RMSNorm), W_O's output, the
    attention's output (what the residual add receives) and the recorded gate scores."""
    attn, seen = model.blocks[0].attn, {}
    hooks = [
        attn.register_forward_pre_hook(lambda m, args: seen.__setitem__("x", args[0])),
        attn.o_proj.register_forward_hook(lambda m, args, out: seen.__setitem__("wo", out)),
        attn.register_forward_hook(lambda m, args, out: seen.__setitem__("out", out)),
    ]
    attn.gate.record = True
    try:
        model(tokens)
    finally:
        for h in hooks:
            h.remove()
    return {**seen, "scores": attn.gate.recorded_scores}


def test_the_g5_score_is_computed_from_the_pre_normed_hidden_state() -> None:
    """sigmoid(X W_g) with X = RMSNorm(h) * gain, the input of every gate (Section 2.1), times
    W_O's output, before the residual add. The raw residual stream, or X without the norm's gain,
    gives other scores: a model that swapped the input fails this."""
    model = build(G5)
    block = model.blocks[0]
    with torch.no_grad():  # a gain far from 1, so the gain-less and the gained X differ
        block.attn_norm.weight.copy_(torch.linspace(0.2, 3.0, D, dtype=torch.float64))
    tokens = torch.randint(0, 64, (2, 9))
    seen = _attention_io(model, tokens)
    h = model.embed(tokens)  # block 0's residual-stream input
    x = block.attn_norm(h)
    w_gate = block.attn.in_proj.weight[-D:]  # the gate's D x D slice of the fused q|k|v|gate projection
    expected = torch.sigmoid(x @ w_gate.T)
    assert seen["scores"].shape == (2, 9, 1, D)
    torch.testing.assert_close(seen["x"], x, rtol=0, atol=0)
    torch.testing.assert_close(seen["scores"].view(2, 9, D), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(seen["out"], seen["wo"] * expected, rtol=0, atol=1e-12)
    unnormed = torch.sigmoid(h @ w_gate.T)
    no_gain = torch.sigmoid(torch.nn.functional.rms_norm(h, (D,), eps=SMALL.norm_eps) @ w_gate.T)
    for other in (unnormed, no_gain, torch.sigmoid(seen["wo"] @ w_gate.T)):
        assert (other - expected).abs().max() > 1e-2


def test_the_input_independent_g5_gate_scales_each_channel_the_same_for_every_input() -> None:
    model = build(G5_STATIC)
    logits = torch.linspace(-2.0, 2.0, D, dtype=torch.float64)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.gate.static_logits.copy_(logits.view(1, D))
    assert model.blocks[0].attn.gate.static_logits.shape == (1, D)
    outputs = [
        _attention_io(model, torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(s)))
        for s in (1, 2)
    ]
    for seen in outputs:
        assert seen["scores"].shape == (2, 7, 1, D)
        torch.testing.assert_close(seen["scores"], torch.sigmoid(logits).expand(2, 7, 1, D), rtol=0, atol=0)
        torch.testing.assert_close(seen["out"], seen["wo"] * torch.sigmoid(logits), rtol=0, atol=1e-12)
    assert (outputs[0]["wo"] - outputs[1]["wo"]).abs().max() > 1e-3  # the inputs did differ


def test_the_input_independent_g5_gate_starts_at_one_half() -> None:
    seen = _attention_io(build(G5_STATIC), torch.randint(0, 64, (1, 5)))
    torch.testing.assert_close(seen["out"], seen["wo"] * 0.5, rtol=0, atol=0)  # sigmoid(0)


def test_the_layerscale_starts_at_its_init_learns_and_is_not_decayed() -> None:
    """Y * lambda with lambda = 0.5 at step 0, no activation; AdamW leaves lambda out of weight
    decay (a decayed scale would drift to 0 on its own)."""
    model = build(LAYERSCALE)
    gate = model.blocks[0].attn.gate
    torch.testing.assert_close(
        gate.static_logits, torch.full((1, D), 0.5, dtype=torch.float64), rtol=0, atol=0
    )
    seen = _attention_io(model, torch.randint(0, 64, (2, 6)))
    torch.testing.assert_close(seen["out"], seen["wo"] * 0.5, rtol=0, atol=0)
    groups = adamw(model.train(), TrainConfig(weight_decay=0.1)).param_groups
    no_decay = next(g for g in groups if g["weight_decay"] == 0.0)
    assert any(p is gate.static_logits for p in no_decay["params"])
    model(torch.randint(0, 64, (2, 6))).sum().backward()
    assert gate.static_logits.grad.abs().min() > 0  # every channel's scale learns


def test_a_headwise_g5_gate_scores_each_group_of_output_channels_once() -> None:
    model = build(G5_HEADWISE)
    attn = model.blocks[0].attn
    assert attn.in_proj.weight.shape == (Q * DK + 2 * K * DK + Q, D)  # q | k | v | one gate row per group
    assert (attn.gate.heads, attn.gate.dim, attn.gate.width) == (Q, D // Q, 1)
    tokens = torch.randint(0, 64, (2, 8))
    seen = _attention_io(model, tokens)
    assert seen["scores"].shape == (2, 8, Q, 1)
    expected = torch.sigmoid(seen["x"] @ attn.in_proj.weight[-Q:].T)  # (2, 8, Q)
    torch.testing.assert_close(seen["scores"].view(2, 8, Q), expected, rtol=0, atol=1e-12)
    per_channel = expected.repeat_interleave(D // Q, dim=-1)  # group g covers channels g*6 .. g*6+5
    torch.testing.assert_close(seen["out"], seen["wo"] * per_channel, rtol=0, atol=1e-12)


def test_a_headwise_g5_gate_needs_n_heads_to_divide_d_model() -> None:
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(SMALL, gate=G5_HEADWISE, d_model=26)
    assert err.value.path == "gate.granularity" and "n_heads must divide d_model" in err.value.message


@pytest.mark.parametrize(
    ("kwargs", "path"),
    [
        (dict(static_init=0.5), "static_init"),  # input-dependent: no static logits to start
        (dict(kind="silu", static_init=1.0), "static_init"),
        (dict(input_dependent=False, static_init=float("nan")), "static_init"),
        (dict(position="dense", sharing="head_shared"), "sharing"),
    ],
)
def test_g5_control_settings_that_mean_nothing_are_refused(kwargs: dict, path: str) -> None:
    with pytest.raises(ConfigError) as err:
        GateConfig(**kwargs)
    assert err.value.path == path


def test_a_bad_static_init_in_a_grid_names_the_row_and_key(tmp_path) -> None:
    from sweep.gridfile import GridError

    text = (
        (ROOT / "grids/g5_controls.yaml")
        .read_text()
        .replace("inherit: table1.yaml", f"inherit: {ROOT}/grids/table1.yaml")
    )
    text += "  - {id: bad, model: {gate: {position: dense, static_init: 0.5}}}\n"
    (tmp_path / "g.yaml").write_text(text)
    with pytest.raises(GridError) as err:
        load_grid(tmp_path / "g.yaml")
    assert "row 'bad'" in str(err.value) and "model.gate.static_init" in str(err.value)


# --- run keys ---------------------------------------------------------------------------------------

#: sha256[:16] of each Table 1 row's model section as keyed (identity_dict) at tiny, computed at
#: 9e11fc9, before the G5 controls: a new gate field that entered the keys at its default would
#: change every gated row's run key and orphan their runs.
TABLE1_MODEL_KEYS = {
    "baseline": "a135006613b0dafc",
    "kv8": "ec2dbf3a3dd08d24",
    "q48": "bccdc29fc2dd3c83",
    "add_experts": "350a5ed26a96b3f9",
    "sdpa_elementwise": "d1d070a8e3afc3db",
    "value_elementwise": "b5bd224ea56ac418",
    "key_elementwise": "326c83a48eab4dd5",
    "query_elementwise": "34b80e93397d4709",
    "dense_output": "f158e8d5701c3757",
    "sdpa_headwise": "cc65b15f7e7074ee",
    "value_headwise": "94c7ddcf64eb01b6",
    "sdpa_head_shared": "bf77d9f76c75bd10",
    "value_head_shared": "e1cb9072161ab79f",
    "sdpa_additive_silu": "8ebf710d71b7561a",
    "sdpa_elementwise_silu": "f86da4118e8aad26",
    "sdpa_input_independent": "56b1c5da6dece332",
}
#: the same for the control rows of grids/g5_controls.yaml
CONTROL_MODEL_KEYS = {
    "dense_input_independent": "e1b2c67f7eb6fb2d",
    "dense_layerscale": "6ca31047edd5a8bb",
    "dense_layerscale_one": "3df470086afe3c93",
    "dense_headwise": "78fda7d0c76d4799",
}


def _model_key(grid, scale: str) -> dict[str, str]:
    out = {}
    for cell in grid.cells(scale, seeds=[0]):
        blob = json.dumps(identity_dict(cell.config.model), sort_keys=True, separators=(",", ":"))
        out[cell.row.id] = hashlib.sha256(blob.encode()).hexdigest()[:16]
    return out


def test_table1s_rows_are_keyed_as_before_the_g5_controls() -> None:
    assert _model_key(load_grid(ROOT / "grids/table1.yaml"), "tiny") == TABLE1_MODEL_KEYS


def test_a_gate_at_its_defaults_is_keyed_without_static_init() -> None:
    assert "static_init" not in identity_dict(G5)
    assert identity_dict(LAYERSCALE)["static_init"] == 0.5


def test_the_control_rows_are_keyed_apart_and_stably() -> None:
    keys = _model_key(load_grid(ROOT / "grids/g5_controls.yaml"), "tiny")
    assert {r: keys[r] for r in CONTROL_MODEL_KEYS} == CONTROL_MODEL_KEYS
    assert len(set(keys.values())) == len(keys)  # no two rows train the same model


@pytest.mark.parametrize("scale", ["tiny", "cpu_long"])
def test_the_control_grid_reuses_table1s_cells_of_its_table1_rows(scale: str) -> None:
    """Same run keys as Table 1's (seeds 0-2), so a sweep of the control grid trains only the
    control rows where Table 1 has run; the control rows' keys are none of Table 1's."""
    table1 = {
        (c.row.id, c.seed): c.run_key
        for c in load_grid(ROOT / "grids/table1.yaml").cells(scale, seeds=[0, 1, 2])
    }
    grid = load_grid(ROOT / "grids/g5_controls.yaml")
    assert grid.seeds == [0, 1, 2] and grid.share_of == "dense_output"
    cells = grid.cells(scale)
    shared = {(c.row.id, c.seed): c.run_key for c in cells if c.row.id not in CONTROL_MODEL_KEYS}
    assert {r for r, _ in shared} == {
        "baseline",
        "sdpa_elementwise",
        "sdpa_headwise",
        "sdpa_input_independent",
        "dense_output",
    }
    assert shared == {k: table1[k] for k in shared}
    assert not {c.run_key for c in cells if c.row.id in CONTROL_MODEL_KEYS} & set(table1.values())
