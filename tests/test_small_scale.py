"""Issue 13's controls against small-scale artefacts: the width-aware init, the gate statistics at
step 0, the F-Attn floor, the Bigram-Backcopy task, sequence-aligned windows and the curves report."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from experiments import names as N
from experiments.config import BackcopyConfig, DataConfig, GateConfig, ModelConfig, RunConfig, TrainConfig
from experiments.corpus import build_corpus
from experiments.corpus.backcopy import BOS, bigram_law, copy_positions, generate, task_entropy
from experiments.data import HeldOutWindows, RandomWindows
from experiments.init_stats import init_statistics
from experiments.model import GatedLM
from experiments.probes import first_token_floor, late_query_start, probe_batch, run_probes
from experiments.strict import identity_dict
from sweep.grid import load_grid, run_key
from sweep.report.curves import ranking_stable, side_of_reference
from tests.support import ROOT

TINY = ModelConfig(vocab_size=256, d_model=128, n_layers=1, n_heads=16, n_kv_heads=2, head_dim=16, ffn_dim=64)
PAPER = ModelConfig(
    vocab_size=256, d_model=2048, n_layers=1, n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=64
)


def _logit_std(cfg: ModelConfig, gate: GateConfig | None = None) -> dict[str, float]:
    torch.manual_seed(0)
    model = GatedLM(dataclasses.replace(cfg, gate=gate or GateConfig()))
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    return init_statistics(model, tokens)


# --- width-aware init -------------------------------------------------------------------------------


def test_width_aware_init_gives_the_paper_width_gate_logit_std_at_d_128() -> None:
    paper = _logit_std(PAPER)[N.GATE_LOGIT_STD_INIT]
    fixed = _logit_std(TINY)[N.GATE_LOGIT_STD_INIT]
    aware = _logit_std(dataclasses.replace(TINY, init_ref_width=2048))[N.GATE_LOGIT_STD_INIT]
    assert paper == pytest.approx(0.02 * 2048**0.5, rel=0.05)  # 0.905: std 0.02 over 2048 unit inputs
    assert fixed == pytest.approx(0.02 * 128**0.5, rel=0.05)  # 0.226 with the fixed init
    assert aware == pytest.approx(paper, rel=0.10)


def test_width_aware_init_leaves_the_paper_width_and_the_embeddings_unchanged() -> None:
    models = []
    for ref in (None, 2048):
        torch.manual_seed(0)
        models.append(GatedLM(dataclasses.replace(PAPER, init_ref_width=ref)))
    for (name, a), (_, b) in zip(models[0].state_dict().items(), models[1].state_dict().items()):
        assert torch.equal(a, b), name
    torch.manual_seed(0)
    tiny = GatedLM(dataclasses.replace(TINY, init_ref_width=2048))
    assert float(tiny.embed.weight.detach().std()) == pytest.approx(0.02, rel=0.05)
    assert float(tiny.blocks[0].attn.in_proj.weight.detach().std()) == pytest.approx(0.08, rel=0.05)
    torch.manual_seed(0)
    tied = GatedLM(dataclasses.replace(TINY, init_ref_width=2048, tie_embeddings=True))
    assert float(tied.lm_head.weight.detach().std()) == pytest.approx(0.02, rel=0.05)  # the embedding's


def test_an_option_at_its_default_leaves_the_run_key_alone() -> None:
    cfg = RunConfig()
    assert "init_ref_width" not in identity_dict(cfg.model) and "synthetic" not in identity_dict(cfg.data)
    wider = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_ref_width=2048))
    assert identity_dict(wider.model)["init_ref_width"] == 2048
    assert run_key(wider) != run_key(cfg)


# --- gate statistics at step 0 ------------------------------------------------------------------------


def test_branch_scale_of_constant_gates_and_controls() -> None:
    assert _logit_std(TINY, GateConfig(input_dependent=False))[N.BRANCH_SCALE_INIT] == pytest.approx(0.5)
    assert _logit_std(TINY, GateConfig(activation="ns_sigmoid", input_dependent=False))[
        N.BRANCH_SCALE_INIT
    ] == pytest.approx(0.75)  # 0.5 + 0.5 sigmoid(0)
    assert N.GATE_LOGIT_STD_INIT not in _logit_std(TINY, GateConfig(input_dependent=False))
    silu = _logit_std(TINY, GateConfig(activation="silu"))[N.BRANCH_SCALE_INIT]
    silu_aware = _logit_std(dataclasses.replace(TINY, init_ref_width=2048), GateConfig(activation="silu"))
    assert silu < 0.2 < 0.4 < silu_aware[N.BRANCH_SCALE_INIT]  # SiLU(z) ~ z/2 shrinks small logits
    torch.manual_seed(0)
    assert init_statistics(GatedLM(TINY), torch.zeros(1, 8, dtype=torch.long)) == {}


# --- the F-Attn floor ---------------------------------------------------------------------------------


def test_first_token_floor_by_hand() -> None:
    assert first_token_floor(4) == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)  # 25/48
    assert first_token_floor(4, skip=2) == pytest.approx((1 / 3 + 1 / 4) / 2)
    assert first_token_floor(128) == pytest.approx(0.0425, abs=1e-4)
    assert late_query_start(128) == 16 and late_query_start(12) == 6
    with pytest.raises(ValueError, match="skip"):
        first_token_floor(4, skip=4)


def test_uniform_attention_sits_on_both_floors() -> None:
    torch.manual_seed(0)
    model = GatedLM(dataclasses.replace(TINY, n_layers=2))
    for block in model.blocks:  # q = 0: uniform causal attention
        block.attn.in_proj.weight.data[: block.attn.split_sizes[0]] = 0.0
    result = run_probes(model, torch.randint(0, 256, (2, 40)))
    assert result.summary[N.F_ATTN] == pytest.approx(result.summary[N.F_ATTN_FLOOR])
    assert result.summary[N.F_ATTN_LATE] == pytest.approx(result.summary[N.F_ATTN_LATE_FLOOR])
    assert result.summary[N.F_ATTN_LATE_FLOOR] == pytest.approx(first_token_floor(40, 16))


# --- Bigram-Backcopy ----------------------------------------------------------------------------------

TASK = BackcopyConfig(
    tokens=16, triggers=3, concentration=0.3, seq_tokens=33, train_seqs=200, heldout_seqs=20
)


def test_backcopy_is_deterministic_and_the_splits_differ() -> None:
    a, b = generate(TASK, 50, "train"), generate(TASK, 50, "train")
    assert np.array_equal(a, b) and a.shape == (50, 33) and a.dtype == np.uint16
    assert not np.array_equal(a, generate(TASK, 50, "val"))
    assert not np.array_equal(a, generate(dataclasses.replace(TASK, chain_seed=1), 50, "train"))


def test_backcopy_has_the_documented_structure() -> None:
    law, start = bigram_law(TASK)
    assert np.allclose(law[1:].sum(axis=1), 1.0) and law[:, BOS].sum() == 0 and law[BOS].sum() == 0
    assert start[: TASK.triggers + 1].sum() == 0 and start.sum() == pytest.approx(1.0)
    stationary = np.linalg.matrix_power(law[1:, 1:].T, 200)[:, 0]  # the triggers are the most frequent
    assert set(np.argsort(-stationary)[: TASK.triggers] + 1) == {1, 2, 3}
    seqs = generate(TASK, 400, "train").astype(np.int64)
    assert (seqs[:, 0] == BOS).all() and (seqs[:, 1:] != BOS).all()
    trigger = (seqs >= 1) & (seqs <= TASK.triggers)
    assert not trigger[:, 1].any() and not (trigger[:, :-1] & trigger[:, 1:]).any()  # never two in a row
    copied = copy_positions(seqs, TASK.triggers)
    assert copied.any() and (seqs[copied] == seqs[:, :-2][copied[:, 2:]]).all()  # x_{t+1} = x_{t-1}
    nonzero = law[seqs[:, 1:-1][~copied[:, 2:]], seqs[:, 2:][~copied[:, 2:]]]
    assert (nonzero > 0).all()  # every other token is a bigram draw
    assert 0 < task_entropy(TASK) < np.log(TASK.vocab_size)


def test_windows_of_a_synthetic_corpus_start_at_bos(tmp_path: Path) -> None:
    data = DataConfig(synthetic=TASK)
    corpus = build_corpus(data, tmp_path, log=lambda _m: None)
    assert corpus.sequence_tokens == 33 and corpus.domains == ["backcopy"]
    train = RandomWindows(corpus.tokens("train"), 32, 64, seed=0, sequence_tokens=33)
    assert all(int(train[i][0]) == BOS for i in range(64)) and train[0].shape == (33,)
    held = HeldOutWindows(corpus.tokens("val", "backcopy"), 16, 33 * 5, sequence_tokens=33)
    assert len(held) == 5 and all(int(held[i][0]) == BOS for i in range(5))
    batch, _ = probe_batch(corpus, 32, 4)
    assert batch.shape == (4, 32) and (batch[:, 0] == BOS).all()
    with pytest.raises(Exception, match="seq_len"):
        RunConfig(model=ModelConfig(vocab_size=17), data=data, train=TrainConfig(seq_len=64))


def test_sink_grid_has_the_issues_rows_and_three_seeds() -> None:
    grid = load_grid(ROOT / "grids/sink.yaml")
    assert grid.row_ids()[:5] == [
        "baseline", "sdpa_elementwise", "sdpa_headwise", "sdpa_input_independent", "sdpa_ns_sigmoid"
    ]  # fmt: skip
    assert grid.seeds == [0, 1, 2]
    cfg = grid.baseline_config("tiny")
    assert cfg.data.synthetic is not None and cfg.model.vocab_size == cfg.data.synthetic.vocab_size
    # issue 31: no QK-norm, where the baseline's sink is clear; the QK-norm pair is the control
    control = {c.row.id: c.config.model for c in grid.cells("tiny", seeds=[0])}
    assert not cfg.model.qk_norm and control["baseline_qk_norm"].qk_norm
    assert (
        control["sdpa_elementwise_qk_norm"].qk_norm
        and control["sdpa_elementwise_qk_norm"].gate.position == "sdpa"
    )


# --- the curves report -----------------------------------------------------------------------------


def test_side_of_reference_and_ranking_on_made_up_curves() -> None:
    grid = load_grid(ROOT / "grids/table1.yaml")
    steps = [100, 200, 300, 400]
    mean = pd.DataFrame(
        [[500, 300, 200, 150], [450, 280, 190, 140], [400, 310, 160, 160], [520, 330, 210, 155]],
        index=["baseline", "sdpa_elementwise", "dense_output", "sdpa_elementwise_silu"],
        columns=steps,
    )
    sides = side_of_reference(mean, grid)  # last half: steps 200..400
    assert sides == {
        "sdpa_elementwise": "better",
        "dense_output": "flips at 300, 400",
        "sdpa_elementwise_silu": "worse",
    }
    assert ranking_stable(mean, ["baseline", "sdpa_elementwise"]) is True  # last third: 300, 400
    assert ranking_stable(mean, ["baseline", "dense_output"]) is False
    assert ranking_stable(mean, ["baseline", "kv8"]) is None
