"""Sharded cells (``train.strategy: fsdp``: Lightning's ModelParallelStrategy, FSDP2) on two CPU
processes over gloo train as one process does.

A dense and a MoE micro model sharded over two ranks give, step by step, one process's losses,
its validation and, gathered, its final weights; they resume exactly from their folder of
shards, on two ranks or on one; the sweep's run of a sharded cell holds one process's every
metric (the step-0 gate statistics and the probes included). A rank killed with ``kill -9`` costs
the steps since the last checkpoint and no step twice; two "nodes" meet at a c10d rendezvous; the
SLURM job's ``srun torchrun`` gives each rank the place SLURM's variables say.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import stat
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mlflow import MlflowClient

from experiments import names as N
from experiments.checkpointing import checkpoint_problem, latest_checkpoint
from experiments.config import RunConfig
from experiments.train import Training
from sweep.cli import main
from sweep.run.ranks import launch
from tests.support import (
    LONG_MICRO,
    LONG_STEPS,
    MICRO,
    ROOT,
    assert_close,
    ranks_of,
    start_slow_cli,
    wait_for_checkpoint,
    weights,
)
from tests.test_ddp import DATA, KINDS, TRAIN, LossRecorder

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend"),
    pytest.mark.filterwarnings("ignore:You called .self.log:UserWarning"),  # no logger
]
FSDP = {"devices": 2, "strategy": "fsdp"}


def sharded(cfg: RunConfig, **train: Any) -> RunConfig:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **{**FSDP, **train}))


def train(cfg: RunConfig, checkpoints: Path, final: Path, resume: Path | None = None) -> dict:
    """Fit ``cfg`` (one rank of it), validate, save the final weights and probe; the losses, the
    last validation's figures, the probes' summary and the reduce-scatters each rank made."""
    recorder, counted = LossRecorder(), _count_reduce_scatters()
    run = Training(cfg, cache_root=ROOT / ".cache", callbacks=[recorder], checkpoints=checkpoints)
    run.fit(resume)
    figures = run.finish()
    run.save_weights(final)
    probes = run.probe().summary
    return {"losses": recorder.losses, "val": figures, "probes": probes, "reduce_scatters": counted[0]}


def _count_reduce_scatters() -> list[int]:
    """Count this process's reduce-scatters from now on (FSDP's gradient reductions; torch 2.13
    calls ``reduce_scatter_single``, older ones ``reduce_scatter_tensor``)."""
    count = [0]
    for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
        if hasattr(dist, name):
            setattr(dist, name, _counting(getattr(dist, name), count))
    return count


def _counting(original: Any, count: list[int]) -> Any:
    def counting(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return original(*args, **kwargs)

    return counting


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_two_sharded_gloo_ranks_train_resume_and_gather_as_one_process(kind: str, tmp_path: Path) -> None:
    one_cfg = RunConfig(model=KINDS[kind], train=TRAIN, data=DATA)
    two_cfg = sharded(one_cfg)
    one = train(one_cfg, tmp_path / "one", tmp_path / "one.ckpt")
    two = launch(train, 2, two_cfg, tmp_path / "two", tmp_path / "two.ckpt")
    assert len(one["losses"]) == len(two["losses"]) == TRAIN.max_steps
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert two["val"] == pytest.approx(one["val"], rel=1e-5)
    assert two["probes"] == pytest.approx(one["probes"], rel=1e-4, abs=1e-6)
    # The final weights: one file, gathered whole, as one process writes it.
    assert checkpoint_problem(tmp_path / "two.ckpt") is None
    assert_close(weights(tmp_path / "two.ckpt"), weights(tmp_path / "one.ckpt"))

    # The mid-run state: a folder of both ranks' shards, its record beside it.
    mid = tmp_path / "two" / "step000003.ckpt"
    assert mid.is_dir() and latest_checkpoint(tmp_path / "two") == mid and checkpoint_problem(mid) is None
    record = json.loads((tmp_path / "two" / "step000003.ckpt.sha256").read_text())["files"]
    assert sorted(record) == sorted(p.name for p in mid.iterdir())
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"} <= set(record)

    # Both ranks resume to the same weights; so does one rank (DCP reshards on load).
    resumed = launch(train, 2, two_cfg, tmp_path / "r2", tmp_path / "r2.ckpt", mid)
    assert resumed["losses"] == two["losses"][3:]
    assert_close(weights(tmp_path / "r2.ckpt"), weights(tmp_path / "two.ckpt"))
    one_rank = launch(train, 1, sharded(one_cfg, devices=1), tmp_path / "r1", tmp_path / "r1.ckpt", mid)
    assert one_rank["losses"] == pytest.approx(two["losses"][3:], rel=1e-5)
    assert_close(weights(tmp_path / "r1.ckpt"), weights(tmp_path / "two.ckpt"))


@pytest.mark.parametrize("sync", ["step", "micro_batch"])
def test_sharded_micro_batches_reduce_once_a_step_or_after_each(sync: str, tmp_path: Path) -> None:
    """``grad_accum: 2`` on two ranks (one sequence a micro-batch): one process's losses and
    weights either way; ``grad_sync: step`` reduce-scatters each unit's gradients once a step (3
    units: 2 blocks and the root), ``micro_batch`` after each of its 2 micro-batches."""
    one_cfg = RunConfig(model=KINDS["dense"], train=TRAIN, data=DATA)
    cfg = sharded(one_cfg, grad_accum=2, grad_sync=sync, checkpoint_every=0)
    one = train(one_cfg, tmp_path / "one", tmp_path / "one.ckpt")
    two = launch(train, 2, cfg, tmp_path / "two", tmp_path / "two.ckpt")
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert_close(weights(tmp_path / "two.ckpt"), weights(tmp_path / "one.ckpt"))
    units, per_step = 3, 1 if sync == "step" else 2
    assert two["reduce_scatters"] == units * per_step * TRAIN.max_steps


def test_a_moe_with_activation_checkpointing_trains_sharded_as_one_process(tmp_path: Path) -> None:
    """Each block recomputed in the backward pass: one process's losses and weights (the MoE's
    recomputed routing adds to the same micro-batches as its forward)."""
    one_cfg = RunConfig(model=KINDS["moe"], train=TRAIN, data=DATA)
    cfg = sharded(one_cfg, activation_checkpointing=True, checkpoint_every=0)
    one = train(one_cfg, tmp_path / "one", tmp_path / "one.ckpt")
    two = launch(train, 2, cfg, tmp_path / "two", tmp_path / "two.ckpt")
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert_close(weights(tmp_path / "two.ckpt"), weights(tmp_path / "one.ckpt"))


def _cells(results: Path) -> dict[str, tuple[dict[str, list[tuple[int, float]]], Path]]:
    """Every finished cell run by row: its metrics (key -> [(step, value)] by step, wall-clock
    figures left out) and its final weights."""
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny")
    runs = client.search_runs([exp.experiment_id], "tags.kind = 'cell' and tags.status = 'finished'")
    return {
        run.data.tags["row"]: (
            {
                key: sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
                for key in run.data.metrics
                if not key.startswith("system/") and key != N.TRAIN_TOKENS_PER_S
            },
            Path(run.data.tags["checkpoint"]),
        )
        for run in runs
    }


def test_the_sweep_trains_sharded_cells_with_one_process_metrics(tmp_path: Path, repo_cache: None) -> None:
    """``train: {devices: 2, strategy: fsdp}``: the gated and the MoE row hold every metric one
    process logs (losses, validations, the step-0 gate statistics, the probes), each step once,
    with the same values, and the same final weights."""
    sharded_text = MICRO.replace("max_lr: 2e-3}", "max_lr: 2e-3, devices: 2, strategy: fsdp}")
    assert sharded_text != MICRO
    found = {}
    for name, text in (("one", MICRO), ("two", sharded_text)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "grid.yaml").write_text(text)
        results = tmp_path / name / "results"
        args = ["sweep", "--grid", str(tmp_path / name / "grid.yaml"), "--results", str(results)]
        assert main([*args, "--rows", "sdpa_elementwise,moe", "--workers", "1"]) == 0
        found[name] = _cells(results)
    assert found["one"].keys() == found["two"].keys() == {"sdpa_elementwise", "moe"}
    gated = found["one"]["sdpa_elementwise"][0]
    assert {N.TRAIN_LOSS, N.VAL_PPL_AVG, N.BRANCH_SCALE_INIT, N.GATE_LOGIT_STD_INIT, N.F_ATTN} <= gated.keys()
    for row, (one, one_final) in found["one"].items():
        two, two_final = found["two"][row]
        assert one.keys() == two.keys(), row
        for key in one:
            assert [s for s, _ in two[key]] == [s for s, _ in one[key]], (row, key)
            values = [v for _, v in two[key]]
            assert values == pytest.approx([v for _, v in one[key]], rel=1e-4, abs=1e-6), (row, key)
        assert_close(weights(two_final), weights(one_final))
