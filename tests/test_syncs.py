"""The training step's steady state never waits for the device (issue 44): the host syncs a CUDA
step would make, counted on the CPU (``tools/syncs.py``) through the real recipe (Lightning,
clipping, logging, the checks), step by step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from experiments.train import Training
from sweep.grid import load_grid
from tests.support import MICRO, use_repo_cache, write_grid
from tools.syncs import HostSyncCounter, StepSyncs

LOG_EVERY = 4
STEPS = 12


def _config(tmp_path: Path, row: str, **train: object):
    grid = load_grid(write_grid(tmp_path, MICRO))
    (cell,) = grid.cells("tiny", rows=[row])
    t = dataclasses.replace(
        cell.config.train, max_steps=STEPS, log_every=LOG_EVERY, val_every=STEPS, checkpoint_every=0, **train
    )
    return dataclasses.replace(cell.config, train=t)


@pytest.mark.parametrize(
    "row, precision", [("sdpa_elementwise", "32-true"), ("moe", "32-true"), ("moe", "bf16-mixed")]
)
def test_no_host_sync_between_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row: str, precision: str
) -> None:
    use_repo_cache(monkeypatch)
    counter = StepSyncs()
    cfg = _config(tmp_path, row, precision=precision)  # bf16-mixed: CPU autocast, as a GPU trains
    run = Training(cfg, logger=CSVLogger(tmp_path / "logs"), callbacks=[counter])
    run.fit()
    checks = {s for s in range(STEPS) if (s + 1) % LOG_EVERY == 0}
    steady = counter.steady(LOG_EVERY)
    assert len(steady) == STEPS - len(checks) - 1
    assert all(not c for c in steady.values()), steady
    # the counter sees the syncs that remain: each check reads the queued figures once
    assert all(sum(counter.steps[s].values()) >= 1 for s in checks)
    logged = (tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert logged.count("\n") > 1 and "train/loss" in logged


def test_the_counter_sees_each_kind_of_sync() -> None:
    t = torch.arange(6.0)
    with HostSyncCounter() as syncs:
        float(t.sum()), t.tolist(), torch.bincount(t.long()), t.nonzero(), t.repeat_interleave(t.long())
        t.repeat_interleave(2)  # an int count: sized by the shapes, no sync
        torch.zeros(3).scatter_add_(0, torch.tensor([0, 2, 2]), torch.ones(3))  # the MoE's counts
        t[t > 2]  # a boolean mask: a nonzero inside
        t.to("meta")  # a copy off the host (the meta device stands in for a GPU)
    assert syncs.counts == {
        "aten._local_scalar_dense": 1,
        "Tensor.tolist": 1,
        "aten.bincount": 1,
        "aten.nonzero": 1,
        "aten.repeat_interleave(tensor repeats)": 1,
        "aten.index(boolean mask)": 1,
        "aten._to_copy(host <-> device)": 1,
    }
