"""What a sharded cell is made of, in one process: the meta-device build whose replay draws one
process's weights, activation checkpointing that changes no number, the sharded checkpoint's
record, the memory plan and the checks built on it (``make params``, the sweep's refusal), and
the settings of the shipped ``paper`` rows. The training on two ranks is ``tests/test_fsdp.py``'s."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

from experiments.checkpointing import (
    checkpoint_problem,
    drop_step_checkpoints,
    latest_checkpoint,
    remove_checkpoint,
)
from experiments.config import ConfigError, GateConfig, RunConfig, TrainConfig
from experiments.memory import (
    GIB,
    RUNTIME_GIB,
    USABLE,
    count_saved,
    memory_plan,
    memory_problem,
    saved_activations,
)
from experiments.meta_init import record_build
from experiments.model import GatedLM, count_parameters
from experiments.sharded_checkpoints import _own_records, sum_path
from experiments.train import Training, lightning_strategy
from sweep.cli import main
from sweep.grid import load_grid, run_key
from sweep.run.placement import check_runnable
from tests.support import DATA, KINDS, MODEL, ROOT, TRAIN

BUILDS = {
    "dense": MODEL,
    "moe": KINDS["moe"],
    "tied, width-aware init": dataclasses.replace(MODEL, tie_embeddings=True, init_ref_width=128),
    "static gate": dataclasses.replace(MODEL, gate=GateConfig(position="sdpa", input_dependent=False)),
    "rmsnorm control": dataclasses.replace(MODEL, gate=GateConfig(position="sdpa", kind="rmsnorm")),
}


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_a_meta_build_replayed_holds_the_weights_a_cpu_build_draws(name: str) -> None:
    cfg = BUILDS[name]
    torch.manual_seed(3)
    state = torch.get_rng_state()
    meta, plan = record_build(lambda: GatedLM(cfg))
    assert all(p.is_meta for p in meta.parameters())
    torch.manual_seed(3)
    cpu = GatedLM(cfg)
    meta.to_empty(device="cpu")
    plan.replay(meta, state)
    want, got = cpu.state_dict(), meta.state_dict()
    assert want.keys() == got.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)


class _Drawn(nn.Module):
    def __init__(self, draw: str) -> None:
        super().__init__()
        if draw == "randint":
            self.w = nn.Parameter(torch.randint(0, 5, (3,)).float())
        else:  # a weight computed by arithmetic, never set by an init call
            self.w = nn.Parameter(torch.randn(3) * 2)


@pytest.mark.parametrize(
    ("draw", "message"),
    [
        ("randint", "torch.randint draws numbers a meta-device build cannot replay"),
        ("arithmetic", "parameter w: no recorded call set its value"),
    ],
)
def test_a_meta_build_refuses_a_weight_it_cannot_replay(draw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        record_build(lambda: _Drawn(draw))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_activation_checkpointing_changes_no_number(kind: str) -> None:
    """Each block recomputed in the backward pass: the same losses and weights, bit for bit; the
    MoE over two micro-batches a step, whose recomputed routing adds to the step's first."""
    t = dataclasses.replace(TRAIN, max_steps=3, grad_accum=2, checkpoint_every=0, val_every=3)
    found = []
    for checkpointing in (False, True):
        train = dataclasses.replace(t, activation_checkpointing=checkpointing)
        cfg = RunConfig(model=KINDS[kind], train=train, data=DATA)
        run = Training(cfg, cache_root=ROOT / ".cache")
        run.fit()
        found.append((run.module.last_val, run.module.model.state_dict()))
    (val, plain), (val_ckpt, ckpt) = found
    assert val_ckpt == val
    assert all(torch.equal(ckpt[k], plain[k]) for k in plain)


def _folder(tmp_path: Path) -> Path:
    """A checkpoint folder as rank 0 of one writes it: shards, metadata, and its record."""
    folder = tmp_path / "step000004.ckpt"
    folder.mkdir()
    for name, data in (("__0_0.distcp", b"shards"), (".metadata", b"plan"), ("meta.pt", b"loops")):
        (folder / name).write_bytes(data)
    sum_path(folder).write_text(json.dumps({"files": _own_records(folder, 0)}))
    return folder


def test_a_sharded_checkpoint_is_checked_file_by_file_against_its_record(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    assert checkpoint_problem(folder) is None and latest_checkpoint(tmp_path) == folder
    (folder / "__0_0.distcp").write_bytes(b"Shards")
    assert checkpoint_problem(folder) == "__0_0.distcp changed since it was written (another sha256)"
    (folder / "__0_0.distcp").write_bytes(b"shard")
    assert checkpoint_problem(folder) == "__0_0.distcp: 5 bytes, 6 when written"
    (folder / "__0_0.distcp").unlink()
    assert (
        checkpoint_problem(folder)
        == "a folder of other files than written (missing ['__0_0.distcp'], extra [])"
    )
    sum_path(folder).unlink()
    assert checkpoint_problem(folder) == "a folder without its record step000004.ckpt.sha256"


def test_sharded_checkpoints_are_removed_whole(tmp_path: Path) -> None:
    remove_checkpoint(_folder(tmp_path))
    assert list(tmp_path.iterdir()) == []
    _folder(tmp_path)
    (tmp_path / "step000008.ckpt.tmp").mkdir()  # a save killed midway
    (tmp_path / "final.ckpt").write_bytes(b"weights")
    drop_step_checkpoints(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["final.ckpt"]


def test_the_memory_plan_measures_on_the_meta_device_what_a_cpu_forward_saves() -> None:
    """The MoE micro model in fp32: the meta device's bytes, block by block, are the CPU's."""
    torch.manual_seed(0)
    tokens = torch.randint(0, MODEL.vocab_size, (2, 33))
    cpu = count_saved(GatedLM(KINDS["moe"]), tokens)
    meta = saved_activations(KINDS["moe"], 2, 32, 4)
    assert (list(meta.per_block), meta.outside) == (cpu[0], cpu[1])
    assert min(cpu[0]) > 0 and cpu[1] >= 2 * 32 * MODEL.vocab_size * 4  # the loss's fp32 log-softmax


def test_the_memory_plan_divides_the_states_over_the_ranks_and_checkpointing_keeps_block_inputs() -> None:
    cfg = RunConfig(
        model=KINDS["moe"], train=dataclasses.replace(TRAIN, devices=2, strategy="fsdp"), data=DATA
    )
    n = count_parameters(GatedLM(KINDS["moe"]))
    plan = memory_plan(cfg)
    assert plan.precision == "bf16-mixed"  # auto, on a GPU
    assert (plan.weights, plan.gradients, plan.optimizer) == pytest.approx(
        (4 * n / 2 / GIB, 4 * n / 2 / GIB, 8 * n / 2 / GIB)
    )
    saved = saved_activations(KINDS["moe"], 2, 32, 2)
    tokens, logit_grad = 2 * 32, 2 * 32 * MODEL.vocab_size * 6
    assert plan.activations == pytest.approx((saved.total + logit_grad) / GIB)
    inputs = MODEL.n_layers * tokens * MODEL.d_model * 2
    assert plan.activations_checkpointed == pytest.approx(
        (saved.outside + inputs + max(saved.per_block) + logit_grad) / GIB
    )
    assert plan.activations_checkpointed < plan.activations
    assert plan.total == pytest.approx(plan.weights * 4 + plan.gathered + plan.activations + RUNTIME_GIB)
    # Deferred reduction holds the whole unsharded gradient; DDP holds everything and its buckets.
    accum = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum=2))
    assert memory_plan(accum).gradients == pytest.approx(plan.gradients + 4 * n / GIB)
    ddp = memory_plan(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, strategy="ddp")))
    assert (ddp.weights, ddp.gradients, ddp.gathered) == pytest.approx((4 * n / GIB, 8 * n / GIB, 0))


@pytest.mark.parametrize("grid", ["table1", "table2", "table5"])
def test_the_shipped_paper_rows_fit_an_80_gb_gpu(grid: str) -> None:
    loaded = load_grid(ROOT / f"grids/{grid}.yaml")
    cells = loaded.cells("paper", seeds=[0])
    for cell in cells:
        t = cell.config.train
        assert (t.strategy, t.world_size, t.gpu_memory_gib, t.activation_checkpointing) == (
            "fsdp",
            128,
            80,
            True,
        )
        assert memory_problem(cell.config) == "", cell.row.id
        assert memory_plan(cell.config).total < USABLE * 80
    check_runnable(loaded, cells, nodes=None)  # the cluster driver: nothing refused


def test_a_paper_row_that_cannot_fit_is_refused_before_anything_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    text = (
        (ROOT / "grids/table1.yaml")
        .read_text()
        .replace("activation_checkpointing: true", "activation_checkpointing: false")
    )
    grid = tmp_path / "table1.yaml"
    grid.write_text(text)
    results = tmp_path / "results"
    args = ["sweep", "--grid", str(grid), "--scale", "paper", "--rows", "baseline", "--results", str(results)]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and not results.exists()
    assert err.startswith(
        f"error: {grid}: row 'baseline': train.gpu_memory_gib: needs 94.0 GiB a GPU under fsdp"
    )
    assert "over 90% of 80 GiB" in err and "train.activation_checkpointing: true" in err


def test_the_paper_scale_trains_sharded_over_128_gpus() -> None:
    (cell,) = load_grid(ROOT / "grids/table1.yaml").cells("paper", rows=["baseline"])
    t = cell.config.train
    assert (t.devices, t.num_nodes, t.grad_accum, t.device_batch, t.grad_sync) == (8, 16, 2, 4, "micro_batch")
    strategy = lightning_strategy(t)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (128, 1)
    assert not strategy.defer_grad_sync
    assert lightning_strategy(TRAIN) == "auto"


def test_a_micro_batch_size_sets_the_micro_batches_a_step() -> None:
    t = TrainConfig(batch_size=1024, devices=8, num_nodes=16, micro_batch=4, strategy="fsdp")
    assert (t.grad_accum, t.device_batch) == (2, 4)
    assert dataclasses.replace(t, batch_size=4096, grad_accum=1).grad_accum == 8  # a row's x4 batch
    with pytest.raises(ConfigError, match="grad_accum: set grad_accum or micro_batch, not both"):
        TrainConfig(batch_size=1024, devices=8, num_nodes=16, micro_batch=4, grad_accum=4)
    with pytest.raises(ConfigError, match="micro_batch: the global batch 1000 does not split"):
        TrainConfig(batch_size=1000, devices=8, num_nodes=16, micro_batch=4)
    with pytest.raises(ConfigError, match="grad_sync: micro_batch needs strategy fsdp"):
        TrainConfig(grad_sync="micro_batch")


def test_where_and_how_a_cell_trains_leaves_its_run_key() -> None:
    cfg = RunConfig(model=MODEL, train=TRAIN, data=DATA)
    placed = dataclasses.replace(
        TRAIN, devices=2, strategy="fsdp", micro_batch=1, grad_sync="micro_batch",
        activation_checkpointing=True, gpu_memory_gib=80,
    )  # fmt: skip
    assert run_key(dataclasses.replace(cfg, train=placed)) == run_key(cfg)
