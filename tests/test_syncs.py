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


#: Installed in every process of a sweep through PYTHONPATH, from outside the project: in each
#: rank (torchrun's RANK), torch.distributed's collectives and every Python-level host read of a
#: tensor are counted per training step (Lightning's on_train_batch_start hook marks a step's
#: start), and the counts are written to $COUNT_DIR/rank<N>.json as they change.
COUNTING_SITECUSTOMIZE = """
import os
if os.environ.get("COUNT_DIR") and "RANK" in os.environ:
    import collections, json
    import torch, torch.distributed as dist
    import lightning.pytorch.trainer.call as call
    step, counts = [-1], collections.defaultdict(collections.Counter)
    out = os.path.join(os.environ["COUNT_DIR"], "rank" + os.environ["RANK"] + ".json")

    def wrap(owner, name, label):
        original = getattr(owner, name)
        def counted(*args, **kwargs):
            counts[step[0]][label] += 1
            return original(*args, **kwargs)
        setattr(owner, name, counted)

    for name in ("barrier", "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                 "reduce_scatter_tensor", "broadcast_object_list", "all_gather_object"):
        wrap(dist, name, name)
    for name in ("item", "tolist", "numpy", "__int__", "__float__", "__bool__", "__index__"):
        wrap(torch.Tensor, name, "host read")
    hooks = call._call_callback_hooks

    def marked(trainer, hook_name, *args, **kwargs):
        if hook_name == "on_train_batch_start":
            step[0] = trainer.global_step
            with open(out, "w") as f:
                json.dump({"step": step[0], "counts": {str(s): dict(c) for s, c in counts.items()}}, f)
        return hooks(trainer, hook_name, *args, **kwargs)

    call._call_callback_hooks = marked
"""


@pytest.mark.slow
def test_a_two_rank_cell_neither_waits_nor_reads_between_checks(tmp_path: Path) -> None:
    """A dense and a MoE micro cell on two gloo ranks (DDP), trained through the CLI with
    ``torch.distributed`` and the tensors' host reads wrapped from outside the project: between
    checks a step calls no barrier, reads nothing on the host, and all-reduces only the MoE's
    global-batch counts and probability sums (2 a layer); each check reads once."""
    import json
    import os
    import subprocess
    import sys

    from tests.support import ROOT

    site, counts = tmp_path / "site", tmp_path / "counts"
    site.mkdir(), counts.mkdir()
    (site / "sitecustomize.py").write_text(COUNTING_SITECUSTOMIZE)
    train = f"max_steps: {STEPS}, log_every: {LOG_EVERY}, val_every: {STEPS}, checkpoint_every: 0"
    text = MICRO.replace("max_steps: 8,", "").replace("val_every: 4,", "")
    text = text.replace("max_lr: 2e-3}", f"max_lr: 2e-3, {train}, devices: 2, strategy: ddp}}")
    grid = write_grid(tmp_path, text)
    env = {**os.environ, "PYTHONPATH": f"{site}:{ROOT}", "COUNT_DIR": str(counts),
           "GATED_ATTN_CACHE": str(ROOT / ".cache")}  # fmt: skip
    env.pop("MLFLOW_TRACKING_URI", None)
    for row, all_reduces in (("baseline", 0), ("moe", 2 * 2)):
        command = [sys.executable, "-m", "sweep.cli", "sweep", "--grid", str(grid), "--rows", row,
                   "--results", str(tmp_path / row)]  # fmt: skip
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        for rank in (0, 1):
            seen = json.loads((counts / f"rank{rank}.json").read_text())
            assert seen["step"] == STEPS - 1  # written at the last step's start: every step before it
            steps = {s: seen["counts"].get(str(s), {}) for s in range(STEPS - 1)}
            steady = {s: c for s, c in steps.items() if s > 0 and (s + 1) % LOG_EVERY}
            assert all(c.get("barrier", 0) == 0 for c in steady.values()), (row, rank, steady)
            assert all(c.get("host read", 0) == 0 for c in steady.values()), (row, rank, steady)
            assert all(c.get("all_reduce", 0) == all_reduces for c in steady.values()), (row, rank, steady)
            checks = [steps[s] for s in range(LOG_EVERY - 1, STEPS - 1, LOG_EVERY)]
            assert all(c.get("host read", 0) >= 1 and c.get("barrier", 0) == 0 for c in checks), checks
