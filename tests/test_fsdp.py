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
    DATA,
    KINDS,
    LONG_MICRO,
    LONG_STEPS,
    MICRO,
    ROOT,
    TRAIN,
    LossRecorder,
    assert_close,
    ranks_of,
    start_slow_cli,
    wait_for_checkpoint,
    weights,
)

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


def _train_placed(cfg: RunConfig, checkpoints: Path, final: Path) -> dict:
    """:func:`train`, and the placement of the first block's expert and router weights on this rank."""
    recorder = LossRecorder()
    run = Training(cfg, cache_root=ROOT / ".cache", callbacks=[recorder], checkpoints=checkpoints)
    run.fit()
    run.save_weights(final)
    ffn = run.module.model.blocks[0].ffn
    placed = {n: str(p.placements) for n, p in (("w_gate_up", ffn.w_gate_up), ("router", ffn.router.weight))}
    return {"losses": recorder.losses, "placed": placed, "local": tuple(ffn.w_gate_up.to_local().shape)}


def test_experts_that_do_not_split_over_the_ranks_are_split_on_another_dim(tmp_path: Path) -> None:
    """3 experts on 2 ranks (Table 1's 132 on 128): FSDP2 would pad dim 0 to 4 and give each rank
    room for 2; the expert weights split their model dim instead, evenly, and train as one process."""
    moe = dataclasses.replace(KINDS["moe"].moe, n_experts=3)
    one_cfg = RunConfig(model=dataclasses.replace(KINDS["moe"], moe=moe), train=TRAIN, data=DATA)
    one = train(one_cfg, tmp_path / "one", tmp_path / "one.ckpt")
    two = launch(_train_placed, 2, sharded(one_cfg), tmp_path / "two", tmp_path / "two.ckpt")
    assert two["placed"] == {"w_gate_up": "(Shard(dim=1),)", "router": "(Shard(dim=1),)"}
    assert two["local"] == (3, 16, 32)  # (E, d / 2, 2f) of (3, 32, 32)
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert_close(weights(tmp_path / "two.ckpt"), weights(tmp_path / "one.ckpt"))


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

    # A later stage starts sharded from the gathered file: it validates as the run that wrote it.
    started = launch(start_and_validate, 2, two_cfg, tmp_path / "two.ckpt")
    assert started == pytest.approx({k: two["val"][k] for k in started}, rel=1e-5)


def start_and_validate(cfg: RunConfig, start: Path) -> dict[str, float]:
    """Validate ``cfg``'s model started from the weights file ``start`` (``Training.start_from``)."""
    run = Training(cfg, cache_root=ROOT / ".cache")
    run.start_from(start)
    run.trainer.validate(run.module, datamodule=run.datamodule, verbose=False)
    return run.module.last_val


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


def test_a_moe_compiled_with_activation_checkpointing_trains_sharded_as_one_process(tmp_path: Path) -> None:
    """The paper rows' settings: each block compiled, and recomputed in the backward pass (the
    MoE's recomputed routing adds to the same micro-batches as its forward): one eager process's
    losses and weights."""
    one_cfg = RunConfig(model=KINDS["moe"], train=TRAIN, data=DATA)
    cfg = sharded(one_cfg, activation_checkpointing=True, compile=True, checkpoint_every=0)
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


def _environ(pid: int) -> dict[str, str]:
    """A process's environment as it started (``/proc/<pid>/environ``)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_a_rank_killed_with_sigkill_fails_the_cell_and_the_next_sweep_resumes_every_step_once(
    tmp_path: Path, repo_cache: None
) -> None:
    """``kill -9`` of rank 1 mid-cell: rank 0 loses its peer (or torchrun ends it) and the cell is
    failed with its checkpoint folder kept; the next sweep resumes the run from it, and every step is logged
    once (the steps after the checkpoint trained again, none twice in the run)."""
    grid = tmp_path / "grid.yaml"
    grid.write_text(
        LONG_MICRO.replace("checkpoint_every: 5}", "checkpoint_every: 5, devices: 2, strategy: fsdp}")
    )
    results = tmp_path / "results"
    args = ["sweep", "--grid", str(grid), "--results", str(results), "--rows", "moe", "--workers", "1"]
    sweep = start_slow_cli(args)
    wait_for_checkpoint(results, 5, [sweep])
    deadline = time.monotonic() + 60
    while not (ranks := {_environ(pid).get("RANK"): pid for pid in ranks_of(sweep.pid)}).get("1"):
        assert time.monotonic() < deadline, "rank 1 not found"
        time.sleep(0.05)
    os.kill(ranks["1"], signal.SIGKILL)
    out = sweep.communicate(timeout=300)[0]
    assert "moe s0 FAILED: " in out, out  # rank 0's lost connection, or torchrun's end of it

    again = start_slow_cli(args)
    out = again.communicate(timeout=300)[0]
    assert again.returncode == 0, out
    assert "resuming run" in out, out
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny")
    (run,) = client.search_runs([exp.experiment_id], "tags.kind = 'cell'")
    assert (run.data.tags["status"], run.data.tags["resumed"]) == ("finished", "1")
    for key in (N.TRAIN_LOSS, N.VAL_PPL_AVG):
        steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, key))
        assert steps == (list(range(LONG_STEPS)) if key == N.TRAIN_LOSS else [10, 20, 30, 40]), key


def placed(cfg: RunConfig, checkpoints: Path, final: Path) -> dict:
    """:func:`train`, plus each rank's place: torchrun's variables, its agent's SLURM variables
    (the ranks drop their own) and whether any ``SLURM_*`` reached the rank, gathered on rank 0."""
    out = train(cfg, checkpoints, final)
    agent = _environ(os.getppid())  # torchrun, as srun started it
    place = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE")}
    place.update({k: v for k, v in agent.items() if k.startswith("SLURM")})
    place["rank_has_slurm"] = any(k.startswith("SLURM_") for k in os.environ)
    places: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(places, place)
    return {**out, "places": places}


def test_two_nodes_meet_at_a_c10d_rendezvous_and_train_a_sharded_cell(tmp_path: Path) -> None:
    """Two torchrun "nodes" here (``--nnodes 2``, c10d on localhost): the rendezvous makes them
    node ranks 0 and 1, one rank each, and the cell trains as in one process."""
    one_cfg = RunConfig(model=KINDS["moe"], train=TRAIN, data=DATA)
    cfg = sharded(one_cfg, devices=1, num_nodes=2, checkpoint_every=0)
    one = train(one_cfg, tmp_path / "one", tmp_path / "one.ckpt")
    two = launch(placed, 1, cfg, tmp_path / "two", tmp_path / "two.ckpt", nodes=2)
    assert sorted((p["GROUP_RANK"], p["RANK"]) for p in two["places"]) == [("0", "0"), ("1", "1")]
    assert {p["WORLD_SIZE"] for p in two["places"]} == {"2"}
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert_close(weights(tmp_path / "two.ckpt"), weights(tmp_path / "one.ckpt"))


#: A stand-in for SLURM's ``srun`` on this machine: runs the command once per node with the
#: variables SLURM gives each task (one task a node), records its own arguments, and ends the
#: others when one fails (``--kill-on-bad-exit``).
FAKE_SRUN = """#!{python}
import json, os, subprocess, sys
args = sys.argv[1:]
opts = [a for a in args[: args.index("{python}")]]
command = args[len(opts):]
nodes = int(next(a for a in opts if a.startswith("--nodes=")).split("=")[1])
open(os.environ["FAKE_SRUN_LOG"], "w").write(json.dumps(args))
procs = []
for i in range(nodes):
    env = {{**os.environ, "SLURM_PROCID": str(i), "SLURM_NODEID": str(i), "SLURM_LOCALID": "0",
           "SLURM_NNODES": str(nodes), "SLURM_NTASKS": str(nodes), "SLURMD_NODENAME": f"node{{i}}",
           "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_NUM_TASKS": str(nodes)}}
    procs.append(subprocess.Popen(command, env=env))
codes = [p.wait() for p in procs]
sys.exit(max(codes))
"""


def test_the_slurm_job_layout_gives_each_rank_the_place_slurms_variables_say(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside a SLURM job of two nodes (a stand-in ``srun`` here), a cell of ``num_nodes: 2``
    starts as one ``srun`` of torchrun per node, the rendezvous at task 0's host; every rank's
    world is SLURM_NNODES x devices, its node rank is its task's, and no ``SLURM_*`` reaches a
    rank (Lightning would read its place from them)."""
    import socket

    python = sys.executable
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text(FAKE_SRUN.format(python=python))
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{srun.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setenv("FAKE_SRUN_LOG", str(tmp_path / "srun.json"))
    one_cfg = RunConfig(model=KINDS["dense"], train=TRAIN, data=DATA)
    cfg = sharded(one_cfg, devices=1, num_nodes=2, checkpoint_every=0)
    two = launch(placed, 1, cfg, tmp_path / "two", tmp_path / "two.ckpt", nodes=2)
    argv = json.loads((tmp_path / "srun.json").read_text())
    # --mem=0: the job's memory too, on clusters that track it (docs/cluster.md)
    assert argv[:5] == ["--overlap", "--mem=0", "--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert {"--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d"} <= set(argv)
    (endpoint,) = [a.split("=", 1)[1] for a in argv if a.startswith("--rdzv-endpoint=")]
    assert endpoint.rsplit(":", 1)[0] == socket.gethostname()  # task 0's host: this worker's
    places = two["places"]
    assert len(places) == 2 and not any(p["rank_has_slurm"] for p in places)
    for p in places:
        assert int(p["WORLD_SIZE"]) == int(p["SLURM_NNODES"]) * int(p["LOCAL_WORLD_SIZE"]) == 2
        assert int(p["RANK"]) == int(p["GROUP_RANK"]) * int(p["LOCAL_WORLD_SIZE"]) + int(p["LOCAL_RANK"])
    assert sorted(p["SLURM_PROCID"] for p in places) == ["0", "1"]  # one task a node
    assert sorted(p["GROUP_RANK"] for p in places) == ["0", "1"]


def dtypes_in_training(cfg: RunConfig, checkpoints: Path, final: Path) -> dict:
    """Fit ``cfg`` and note the dtypes each part computes and stores in: a block's gathered
    weights, the router's, the RoPE tables, the sharded weights and their gradients."""
    seen: dict[str, str] = {}

    def note(name: str, tensor: torch.Tensor) -> None:
        seen.setdefault(name, str(tensor.dtype).removeprefix("torch."))

    class Watch(LossRecorder):
        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            model = module.model
            note("sharded weight", model.blocks[0].attn.in_proj.weight.to_local())
            note("sharded gradient", model.blocks[0].attn.in_proj.weight.grad.to_local())

    run = Training(cfg, cache_root=ROOT / ".cache", callbacks=[watch := Watch()], checkpoints=checkpoints)
    model = run.module.model
    model.blocks[0].attn.in_proj.register_forward_pre_hook(lambda m, a: note("gathered weight", m.weight))
    router = model.blocks[0].ffn.router
    router.register_forward_pre_hook(lambda m, a: note("router weight", m.weight))
    run.fit()
    note("rope", model.rope.cos)
    return {"dtypes": seen, "losses": watch.losses}


def test_bf16_mixed_gathers_bf16_weights_reduces_into_fp32_shards_and_keeps_fp32_buffers(
    tmp_path: Path,
) -> None:
    """``bf16-mixed`` (``auto`` on a GPU) on two CPU ranks: the blocks compute with bf16 weights,
    the router with fp32 ones; the shards AdamW steps on, their gradients and the RoPE tables
    stay fp32; the losses stay within bf16's rounding of fp32 training's."""
    one_cfg = RunConfig(model=KINDS["moe"], train=TRAIN, data=DATA)
    fp32 = launch(
        dtypes_in_training, 2, sharded(one_cfg, checkpoint_every=0), tmp_path / "a", tmp_path / "a.ckpt"
    )
    bf16 = launch(
        dtypes_in_training,
        2,
        sharded(one_cfg, checkpoint_every=0, precision="bf16-mixed"),
        tmp_path / "b",
        tmp_path / "b.ckpt",
    )
    assert bf16["dtypes"] == {
        "gathered weight": "bfloat16",
        "router weight": "float32",
        "sharded weight": "float32",
        "sharded gradient": "float32",
        "rope": "float32",
    }
    assert set(fp32["dtypes"].values()) == {"float32"}
    assert bf16["losses"] == pytest.approx(fp32["losses"], rel=2e-2)
