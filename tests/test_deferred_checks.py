"""The checks that wait for ``log_every`` (issue 44): between two reads of the device, a step whose
gradient is not finite is skipped on the device (fused AdamW's ``found_inf``: weights, moments and
step count untouched), and the run stops as diverged at the next check, naming that step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from experiments.stability import Diverged
from experiments.train import Training
from sweep.grid import load_grid
from tests.support import MICRO, use_repo_cache, write_grid

BAD_STEP = 5


class PoisonAndWatch(pl.Callback):
    """Makes step ``BAD_STEP``'s gradients NaN; keeps a copy of one weight at every step's start."""

    def __init__(self) -> None:
        self.weights: dict[int, torch.Tensor] = {}
        self.adam_steps: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # noqa: ANN001
        weight = pl_module.model.lm_head.weight
        self.weights[trainer.global_step] = weight.detach().clone()
        state = trainer.optimizers[0].state.get(weight, {})
        self.adam_steps[trainer.global_step] = float(state["step"]) if "step" in state else 0.0

    def on_after_backward(self, trainer, pl_module) -> None:  # noqa: ANN001
        if trainer.global_step == BAD_STEP:
            for p in pl_module.model.parameters():
                p.grad.fill_(float("nan"))


@pytest.mark.parametrize("log_every", [4, 1])
def test_a_non_finite_step_is_skipped_then_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, log_every: int
) -> None:
    use_repo_cache(monkeypatch)
    (cell,) = load_grid(write_grid(tmp_path, MICRO)).cells("tiny", rows=["moe"])
    train = dataclasses.replace(cell.config.train, log_every=log_every, max_steps=12, val_every=12)
    watch = PoisonAndWatch()
    run = Training(dataclasses.replace(cell.config, train=train), callbacks=[watch])
    with pytest.raises(Diverged) as raised:
        run.fit()
    assert (raised.value.step, raised.value.what) == (BAD_STEP, "gradient norm")
    last = max(watch.weights)
    assert last == (7 if log_every == 4 else BAD_STEP)  # the check after step 5: at 7, or at once
    after = run.module.model.lm_head.weight.detach()
    assert torch.isfinite(after).all()
    if log_every == 4:  # step 5 skipped on the device, step 6 trained, step 7 stopped before its update
        assert torch.equal(watch.weights[6], watch.weights[BAD_STEP])
        assert watch.adam_steps[6] == watch.adam_steps[BAD_STEP] == BAD_STEP
        assert not torch.equal(watch.weights[7], watch.weights[6])
        assert torch.equal(after, watch.weights[7])
    else:  # read at once: no update on step 5
        assert torch.equal(after, watch.weights[BAD_STEP])
