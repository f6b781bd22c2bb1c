"""The schedule and the optimiser groups of the LightningModule."""

from __future__ import annotations

import math

import pytest
import torch

from experiments.config import DataConfig, GateConfig, ModelConfig, RunConfig, TrainConfig
from experiments.devices import auto_precision
from experiments.lit import LMModule, lr_at
from tests.support import ROOT

SCHED = TrainConfig(max_steps=100, warmup_steps=10, max_lr=2e-3, min_lr=3e-5)


def test_warmup_is_linear_to_the_max_lr() -> None:
    assert lr_at(0, SCHED) == pytest.approx(2e-3 / 10)
    assert lr_at(4, SCHED) == pytest.approx(2e-3 * 5 / 10)
    assert lr_at(9, SCHED) == pytest.approx(2e-3)


def test_cosine_decays_to_the_min_lr() -> None:
    assert lr_at(10, SCHED) == pytest.approx(2e-3)
    assert lr_at(55, SCHED) == pytest.approx((2e-3 + 3e-5) / 2)  # halfway through the decay
    assert lr_at(100, SCHED) == pytest.approx(3e-5)
    assert lr_at(32, SCHED) == pytest.approx(3e-5 + 0.5 * (2e-3 - 3e-5) * (1 + math.cos(math.pi * 22 / 90)))
    decay = [lr_at(s, SCHED) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_weight_decay_only_on_projection_and_embedding_matrices() -> None:
    model = ModelConfig(
        vocab_size=512,
        d_model=16,
        n_layers=1,
        n_heads=2,
        n_kv_heads=1,
        head_dim=8,
        ffn_dim=32,
        max_seq_len=128,
        gate=GateConfig(input_dependent=False),
    )
    module = LMModule(RunConfig(model=model, data=DataConfig(vocab_size=512)), ["code"])
    optimizer = module.configure_optimizers()["optimizer"]
    decayed, plain = (group["params"] for group in optimizer.param_groups)
    names = {id(p): n for n, p in module.model.named_parameters()}
    assert {names[id(p)] for p in plain} == {
        "blocks.0.attn_norm.weight",
        "blocks.0.ffn_norm.weight",
        "norm.weight",
        "blocks.0.attn.q_norm.weight",
        "blocks.0.attn.k_norm.weight",
        "blocks.0.attn.gate.static_logits",
    }
    assert all(p.dim() == 2 for p in decayed)
    assert (
        optimizer.param_groups[0]["weight_decay"] == 0.1 and optimizer.param_groups[1]["weight_decay"] == 0.0
    )
    assert len(decayed) + len(plain) == len(list(module.model.parameters()))
    assert isinstance(optimizer, torch.optim.AdamW)


def test_precision_is_chosen_by_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert auto_precision("auto") == "32-true"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert auto_precision("auto") == "bf16-mixed"
    # a GPU without native bf16 (V100, T4): emulated bf16 would run without flash attention
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert auto_precision("auto") == "32-true"
    assert auto_precision("32-true") == "32-true"  # an explicit choice wins


def test_each_rank_loads_its_slice_of_every_global_batch() -> None:
    """Two ranks of a global batch of 4 together see exactly the one-process batches, in order, from
    the resumed step on; every epoch keeps its length per rank."""
    from experiments.data import ResumingSampler

    one = list(ResumingSampler(16, start=4))
    ranks = [list(ResumingSampler(16, start=4, rank=r, world=2, batch_size=4)) for r in (0, 1)]
    assert ranks == [[4, 5, 8, 9, 12, 13], [6, 7, 10, 11, 14, 15]]
    per_step = [ranks[0][i : i + 2] + ranks[1][i : i + 2] for i in range(0, 6, 2)]
    assert [i for step in per_step for i in step] == one
    assert len(ResumingSampler(16, rank=1, world=2, batch_size=4)) == 8
    with pytest.raises(ValueError, match="does not split over 3 ranks"):
        ResumingSampler(16, world=3, batch_size=4)


def test_the_global_batch_must_split_over_the_processes() -> None:
    from experiments.config import ConfigError

    assert TrainConfig(batch_size=8, devices=2, num_nodes=2).world_size == 4
    with pytest.raises(ConfigError, match="batch_size: the global batch 6 does not split into train.devices"):
        TrainConfig(batch_size=6, devices=4)
    assert TrainConfig(batch_size=16, devices=2, grad_accum=2).device_batch == 4
    with pytest.raises(ConfigError, match=r"1 x 1 x 3 = 3 equal batches"):
        TrainConfig(batch_size=8, grad_accum=3)
    with pytest.raises(ConfigError, match="grad_accum: must be positive"):
        TrainConfig(grad_accum=0)


@pytest.mark.filterwarnings("ignore:You called .self.log:UserWarning")  # no logger: nothing to log to
def test_the_recipe_trains_a_config_without_the_harness(tmp_path) -> None:
    """``experiments.train.Training`` alone: a micro gated config trains, validates at its last step,
    saves its weights, and probes; the step checkpoint lands where it was asked."""

    from experiments.train import Training

    model = ModelConfig(
        vocab_size=512, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64,
        max_seq_len=32, gate=GateConfig(position="sdpa"),
    )  # fmt: skip
    train = TrainConfig(
        max_steps=5, batch_size=4, seq_len=32, warmup_steps=1, val_every=3, val_tokens=512, checkpoint_every=4
    )
    cfg = RunConfig(model=model, train=train, data=DataConfig(vocab_size=512, max_chars_per_source=200000))
    run = Training(cfg, cache_root=ROOT / ".cache", checkpoints=tmp_path / "ckpt")
    assert (run.trainer.num_devices, run.trainer.max_steps) == (1, 5)
    run.fit()
    final = run.finish()
    assert run.step == 5 and run.module.last_val_step == 5  # validated again after the last step
    domains = [k for k in final if k.startswith("val/ppl/") and k != "val/ppl/avg"]
    assert final["val/ppl/avg"] == pytest.approx(sum(final[k] for k in domains) / len(domains))
    assert final["params/total"] == model.param_counts()[0] == final["params/active"]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "step000004.ckpt",
        "step000004.ckpt.sha256",
    ]
    run.save_weights(tmp_path / "final.ckpt")
    state = torch.load(tmp_path / "final.ckpt", weights_only=True)["state_dict"]
    assert set(state) == {f"model.{k}" for k in run.module.model.state_dict()}
    assert 0 < run.probe().summary["gate/score_mean"] < 1
