"""YaRN RoPE scaling (experiments/model.py) against the paper's formula written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from experiments.config import ModelConfig
from experiments.model import GatedLM, RotaryEmbedding, YarnScaling, rope_inv_freq, yarn_correction_range
from experiments.strict import ConfigError, from_dict

SHAPE = ModelConfig(
    vocab_size=64, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=32, max_seq_len=16
)


def model() -> GatedLM:
    torch.manual_seed(0)
    return GatedLM(SHAPE).eval()


def by_hand(head_dim: int, theta: float, factor: float, original: int) -> list[float]:
    """Peng et al. 2023, Section 3.2, in plain floats: pair d has wavelength 2 pi theta^(2d/D);
    the correction dims are where L / wavelength = beta (32, 1), floored / ceiled; the ramp blends
    theta^(-2d/D) (kept) into theta^(-2d/D) / s (interpolated) between them."""
    low = math.floor(head_dim * math.log(original / (32 * 2 * math.pi)) / (2 * math.log(theta)))
    high = math.ceil(head_dim * math.log(original / (1 * 2 * math.pi)) / (2 * math.log(theta)))
    low, high = max(low, 0), min(high, head_dim - 1)
    out = []
    for d in range(head_dim // 2):
        base = theta ** (-2 * d / head_dim)
        ramp = min(max((d - low) / (high - low), 0.0), 1.0)  # 0: keep, 1: interpolate
        out.append(base / factor * ramp + base * (1 - ramp))
    return out


def test_factor_one_is_plain_rope_bit_for_bit() -> None:
    plain = RotaryEmbedding(8, 64, 10000.0)
    yarn = RotaryEmbedding(8, 64, 10000.0, YarnScaling(factor=1.0, original_max_position=16))
    assert torch.equal(plain.cos, yarn.cos) and torch.equal(plain.sin, yarn.sin)
    m = model()
    tokens = torch.arange(12)[None] % 60 + 1
    before = m(tokens)
    m.set_rope(yarn=YarnScaling(factor=1.0, original_max_position=16))
    assert torch.equal(m(tokens), before)


CASES = [(128, [0], [3, 4, 5, 6, 7]), (2048, [0, 1, 2], [6, 7])]  # (original, kept pairs, pairs / 4)


@pytest.mark.parametrize("original, kept, interpolated", CASES)
def test_inverse_frequencies_of_a_known_case(original: int, kept: list[int], interpolated: list[int]) -> None:
    got = rope_inv_freq(16, 10000.0, YarnScaling(factor=4.0, original_max_position=original)).double()
    plain = torch.tensor([10000.0 ** (-2 * d / 16) for d in range(8)], dtype=torch.float64)
    expected = torch.tensor(by_hand(16, 10000.0, 4.0, original), dtype=torch.float64)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0)
    assert torch.allclose(got[kept], plain[kept], rtol=1e-6, atol=0)
    assert torch.allclose(got[interpolated], plain[interpolated] / 4, rtol=1e-6, atol=0)
    between = [d for d in range(8) if d not in kept + interpolated]
    assert all(plain[d] / 4 < got[d] < plain[d] for d in between)
    # original 128: low = floor(-0.39) -> 0, high = ceil(2.62) = 3: pairs 1, 2 at ramp 1/3, 2/3
    if original == 128:
        assert yarn_correction_range(16, 10000.0, YarnScaling(4.0, 128)) == (0, 3)
        for d, ramp in ((1, 1 / 3), (2, 2 / 3)):
            assert got[d].item() == pytest.approx(plain[d].item() * (1 - ramp + ramp / 4), rel=1e-6)


def test_attention_temperature_scales_the_tables() -> None:
    yarn = YarnScaling(factor=4.0, original_max_position=16)
    assert yarn.attention_temperature() == pytest.approx(0.1 * math.log(4) + 1)
    assert YarnScaling(factor=1.0, original_max_position=16).attention_temperature() == 1.0
    assert YarnScaling(4.0, 16, attention_factor=1.5).attention_temperature() == 1.5
    rope = RotaryEmbedding(8, 32, 10000.0, yarn)
    angles = torch.outer(torch.arange(32, dtype=torch.float32), rope_inv_freq(8, 10000.0, yarn))
    assert torch.allclose(rope.cos[:, :4], angles.cos() * yarn.attention_temperature())
    assert torch.allclose(rope.sin[:, 4:], angles.sin() * yarn.attention_temperature())


def test_set_rope_moves_the_length_limit_and_keeps_the_state_dict() -> None:
    m = model()
    keys = list(m.state_dict())
    with pytest.raises(ValueError, match="exceeds max_seq_len=16"):
        m(torch.ones(1, 17, dtype=torch.long))
    m.set_rope(max_seq_len=40, yarn=YarnScaling(factor=4.0, original_max_position=16))
    assert m.max_seq_len == 40 and m.cfg.max_seq_len == 16
    assert m(torch.ones(1, 40, dtype=torch.long)).shape == (1, 40, 64)
    with pytest.raises(ValueError, match="exceeds max_seq_len=40"):
        m(torch.ones(1, 41, dtype=torch.long))
    assert list(m.state_dict()) == keys
    m.set_rope()
    assert m.max_seq_len == 16 and m.rope.yarn is None
    assert torch.equal(m.rope.cos, RotaryEmbedding(8, 16, SHAPE.rope_theta).cos)


@pytest.mark.parametrize(
    "data, key",
    [
        ({"factor": 0.5, "original_max_position": 16}, "factor"),
        ({"factor": 2.0, "original_max_position": 0}, "original_max_position"),
        ({"factor": 2.0, "original_max_position": 16, "beta_slow": 0.0}, "beta_slow"),
        ({"factor": 2.0, "original_max_position": 16, "beta_fast": 0.5}, "beta_fast"),
        ({"factor": 2.0, "original_max_position": 16, "attention_factor": -1.0}, "attention_factor"),
    ],
)
def test_bad_values_name_their_key(data: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        from_dict(YarnScaling, data, "yarn")
    assert err.value.path == f"yarn.{key}"
