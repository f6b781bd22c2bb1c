"""Loss spikes and divergence: the rule on planted series, and a diverged cell inside a sweep."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from mlflow import MlflowClient

from experiments.config import ConfigError, ModelConfig, RunConfig, TrainConfig
from experiments.lit import LMModule
from experiments.stability import Diverged, SpikeDetector, check_divergence, divergence_bound
from sweep.cli import main
from tests.support import MICRO, use_repo_cache


def test_planted_spike_is_counted_once() -> None:
    detector = SpikeDetector(window=5, z=3.0)
    series = [1.0, 1.1, 0.9, 1.0, 1.0, 1.05, 3.0, float("nan"), 1.5, 1.0]
    flags = [detector.update(step, loss) for step, loss in enumerate(series)]
    # At step 5 the window [1.0, 1.1, 0.9, 1.0, 1.0] has mean 1.0 and std sqrt(0.005) = 0.0707,
    # so 1.05 < 1.0 + 3 * 0.0707 is not a spike. At step 6 the window is [1.1, 0.9, 1.0, 1.0, 1.05]
    # (mean 1.01, std 0.0742) and 3.0 is. NaN is divergence, not a spike; 3.0 then widens the
    # window so that 1.5 passes.
    assert flags == [False] * 6 + [True] + [False] * 3
    assert detector.spikes == [(6, 3.0)]


def test_no_spike_before_the_window_fills() -> None:
    detector = SpikeDetector(window=4, z=1.0)
    assert [detector.update(i, v) for i, v in enumerate([1.0, 1.0, 9.0, 1.0])] == [False] * 4


def test_spike_state_survives_a_checkpoint() -> None:
    a = SpikeDetector(window=3, z=2.0)
    for i, v in enumerate([1.0, 1.2, 0.8, 5.0]):
        a.update(i, v)
    b = SpikeDetector(window=3, z=2.0)
    b.load_state_dict(a.state_dict())
    assert (list(b.recent), b.spikes) == (list(a.recent), a.spikes)


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), 2 * math.log(512) + 0.01])
def test_divergence_bound(loss: float) -> None:
    bound = divergence_bound(512, 2.0)
    assert bound == pytest.approx(12.476649250079015)  # 2 ln 512
    with pytest.raises(Diverged) as err:
        check_divergence(7, loss, bound)
    assert err.value.step == 7
    check_divergence(7, bound - 0.01, bound)  # below the bound: nothing raised


def test_a_nan_loss_marks_the_cell_diverged_keeps_its_checkpoint_and_the_sweep_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    use_repo_cache(monkeypatch)
    original = LMModule.loss

    def planted(self: LMModule, batch, reduction: str = "mean"):
        loss = original(self, batch, reduction)
        if self.training and self.cfg.model.gate is not None and self.global_step >= 5:
            return loss * float("nan")
        return loss

    monkeypatch.setattr(LMModule, "loss", planted)
    grid = tmp_path / "g.yaml"
    grid.write_text(MICRO.replace("max_lr: 2e-3}", "max_lr: 2e-3, checkpoint_every: 2}"))
    results = tmp_path / "r"
    args = ["sweep", "--grid", str(grid), "--results", str(results)]
    assert main(args) == 0  # a diverged cell is a result, not a failure
    out = capsys.readouterr().out
    assert "sdpa_elementwise s0 DIVERGED: training loss nan at step 5 is not finite" in out
    assert "finished 2, resumed 0, skipped 0, diverged 1, failed 0" in out

    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny")
    runs = {r.data.tags["row"]: r for r in client.search_runs([exp.experiment_id], "tags.kind = 'cell'")}
    gated, base = runs["sdpa_elementwise"], runs["baseline"]
    assert gated.data.tags["status"] == "diverged" and base.data.tags["status"] == "finished"
    assert gated.data.metrics["stability/diverged_step"] == 5
    kept = Path(gated.data.tags["checkpoint"])
    assert kept.name == "step000004.ckpt" and kept.is_file()  # the last good one (steps 2 and 4 saved)
    assert "sink/first_token_attn" not in gated.data.metrics  # a blown-up model is not probed
    assert Path(base.data.tags["checkpoint"]).name == "final.ckpt"

    table = pd.read_csv(results / "micro.csv").set_index("id")
    assert table.loc["sdpa_elementwise", "status"] == "diverged"
    assert table.loc["sdpa_elementwise", "n_diverged"] == 1
    assert math.isnan(table.loc["sdpa_elementwise", "avg_ppl"])
    assert "| diverged " in (results / "micro.md").read_text()

    assert main(args) == 0  # a rerun keeps the diverged result instead of retraining it
    assert "0 to train, 3 finished earlier" in capsys.readouterr().out


@pytest.mark.parametrize(("key", "value"), [("spike_window", 1), ("diverge_factor", 1.0)])
def test_degenerate_stability_settings_are_rejected(key: str, value: float) -> None:
    with pytest.raises(ConfigError) as err:
        TrainConfig(**{key: value})
    assert err.value.path == key


def test_a_non_finite_gradient_stops_before_the_optimiser_step() -> None:
    shape = {"d_model": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 8, "ffn_dim": 32}
    cfg = RunConfig(model=ModelConfig(vocab_size=4096, max_seq_len=128, **shape))
    module = LMModule(cfg, ["code"])
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    module.model.embed.weight.grad[3, 1] = float("inf")
    with pytest.raises(Diverged) as err:
        module.configure_gradient_clipping(torch.optim.SGD(module.parameters(), lr=0.1))
    assert err.value.what == "gradient norm" and "gradient norm inf at step 0 is not finite" in str(err.value)


def test_gradients_are_clipped_at_the_global_norm_and_the_norm_before_is_logged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shape = {"d_model": 16, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1, "head_dim": 8, "ffn_dim": 32}
    cfg = RunConfig(model=ModelConfig(vocab_size=4096, max_seq_len=128, **shape))
    module = LMModule(cfg, ["code"])
    logged = {}
    monkeypatch.setattr(module, "log", lambda key, value, **kw: logged.update({key: float(value)}))
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    module.model.embed.weight.grad[3, :2] = torch.tensor([3.0, 4.0])  # global norm 5
    module.configure_gradient_clipping(torch.optim.SGD(module.parameters(), lr=0.1))
    assert logged["train/grad_norm"] == pytest.approx(5.0)
    clipped = module.model.embed.weight.grad[3, :2]
    assert clipped.tolist() == pytest.approx([0.6, 0.8], rel=1e-5)  # scaled to norm grad_clip = 1
