"""One cell on two CPU processes (Lightning DDP over gloo) trains as it does in one process.

The same global batch split over two ranks gives, step by step, the same global-batch losses as
one process, the same step checkpoint and the same final weights; a resume of the two-rank run
from its mid-run checkpoint ends on those weights again. A dense and a MoE cell (its global-batch
load balancing all-reduces the expert counts across the ranks).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from mlflow import MlflowClient

from experiments import names as N
from experiments.checkpointing import step_checkpoint_name
from experiments.config import RunConfig
from experiments.moe import router_stats
from experiments.train import Training
from sweep.cli import main
from sweep.run.ranks import launch
from tests.support import (
    DATA,
    KINDS,
    LONG_MICRO,
    LONG_STEPS,
    MICRO,
    MODEL,
    ROOT,
    TRAIN,
    LossRecorder,
    assert_close,
    histories,
    process_state,
    ranks_of,
    start_slow_cli,
    wait_for_checkpoint,
    weights,
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:You called .self.log:UserWarning"),  # no logger
]
GLOO = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend")


def train(cfg: RunConfig, checkpoints: Path, final: Path, resume: Path | None = None) -> dict:
    """Fit ``cfg`` (one rank of it under DDP), validate, save the final weights; the losses and
    the last validation's figures."""
    recorder = LossRecorder()
    run = Training(cfg, cache_root=ROOT / ".cache", callbacks=[recorder], checkpoints=checkpoints)
    run.fit(resume)
    figures = run.finish()
    run.save_weights(final)
    return {"losses": recorder.losses, "val_loss": figures[N.VAL_LOSS], "world": run.trainer.world_size}


@GLOO
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_two_gloo_ranks_train_as_one_process(kind: str, tmp_path: Path) -> None:
    one_cfg = RunConfig(model=KINDS[kind], train=TRAIN, data=DATA)
    two_cfg = dataclasses.replace(one_cfg, train=dataclasses.replace(TRAIN, devices=2, strategy="ddp"))

    one = train(one_cfg, tmp_path / "one", tmp_path / "one.ckpt")
    two = launch(train, 2, two_cfg, tmp_path / "two", tmp_path / "two.ckpt")
    assert (one["world"], two["world"]) == (1, 2)
    assert len(one["losses"]) == len(two["losses"]) == TRAIN.max_steps
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4)
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-4)
    assert_close(weights(tmp_path / "two.ckpt"), weights(tmp_path / "one.ckpt"))

    # The mid-run training state: one file, written by rank 0, as one process writes it.
    mid = "step000003.ckpt"
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == [mid, f"{mid}.sha256"]
    one_state = torch.load(tmp_path / "one" / mid, weights_only=False)
    two_state = torch.load(tmp_path / "two" / mid, weights_only=False)
    assert_close(two_state["state_dict"], one_state["state_dict"])
    assert two_state["global_step"] == one_state["global_step"] == 3
    for a, b in zip(
        two_state["optimizer_states"][0]["state"].values(), one_state["optimizer_states"][0]["state"].values()
    ):
        assert_close(a, b)

    # Both ranks restore it and finish on the uninterrupted run's weights.
    resumed = launch(train, 2, two_cfg, tmp_path / "two", tmp_path / "resumed.ckpt", tmp_path / "two" / mid)
    assert resumed["losses"] == pytest.approx(two["losses"][3:], rel=1e-5)
    assert_close(weights(tmp_path / "resumed.ckpt"), weights(tmp_path / "two.ckpt"))


@GLOO
def test_micro_batches_accumulate_to_the_global_batch(tmp_path: Path) -> None:
    """Two ranks of two micro-batches of one sequence each (``grad_accum: 2``) step on the global
    batch of four: one process's losses and weights, also after a resume from the mid-run state."""
    one_cfg = RunConfig(model=MODEL, train=TRAIN, data=DATA)
    accum = dataclasses.replace(TRAIN, devices=2, strategy="ddp", grad_accum=2)
    assert accum.device_batch == 1
    cfg = dataclasses.replace(one_cfg, train=accum)

    one = train(one_cfg, tmp_path / "one", tmp_path / "one.ckpt")
    two = launch(train, 2, cfg, tmp_path / "two", tmp_path / "two.ckpt")
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-4) and len(two["losses"]) == TRAIN.max_steps
    assert_close(weights(tmp_path / "two.ckpt"), weights(tmp_path / "one.ckpt"))
    mid = tmp_path / "two" / "step000003.ckpt"
    resumed = launch(train, 2, cfg, tmp_path / "two", tmp_path / "resumed.ckpt", mid)
    assert resumed["losses"] == pytest.approx(two["losses"][3:], rel=1e-5)
    assert_close(weights(tmp_path / "resumed.ckpt"), weights(tmp_path / "two.ckpt"))


class ValidationSteps(pl.Callback):
    """The optimiser step of each validation inside ``fit``."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_end(self, trainer: pl.Trainer, module: Any) -> None:
        self.steps.append(trainer.global_step)


class BalanceWindow(pl.Callback):
    """After each micro-batch, the tokens every MoE layer's balancing ``f`` counted."""

    def __init__(self) -> None:
        self.tokens: list[list[float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, out: Any, batch: Any, i: int) -> None:
        self.tokens.append([float(s.tokens) for s in router_stats(module.model)])


class LateSignal:
    """A stop request (``StopOnRequest``'s) whose SIGTERM arrives during the first micro-batch."""

    def __init__(self) -> None:
        self.asked = 0

    @property
    def signum(self) -> int | None:
        self.asked += 1
        return signal.SIGTERM if self.asked > 1 else None

    def reclaim(self) -> None:
        pass


def test_a_moe_steps_micro_batches_balance_over_its_global_batch_and_validate_between_steps() -> None:
    """``grad_accum: 2``: a step's second micro-batch balances over both (its whole global
    batch), and the next step's first starts afresh (``experiments.moe.carry_balance``);
    ``val_every: 2`` validates after steps 2 and 4, not every 2 micro-batches."""
    train_cfg = dataclasses.replace(TRAIN, grad_accum=2, max_steps=4, val_every=2, checkpoint_every=0)
    window, validated = BalanceWindow(), ValidationSteps()
    cfg = RunConfig(model=KINDS["moe"], train=train_cfg, data=DATA)
    Training(cfg, ROOT / ".cache", callbacks=[window, validated]).fit()
    half = TRAIN.batch_size // 2 * TRAIN.seq_len
    assert window.tokens == [[half] * 2, [2 * half] * 2] * 4  # 4 steps, 2 layers
    assert validated.steps == [2, 4]


@GLOO
def test_fewer_held_out_windows_than_ranks_validate_as_in_one_process(tmp_path: Path) -> None:
    """One window for two ranks (the ``paper`` scales' long-context rows have 63 for 128): no rank
    is left without a validation batch, which Lightning refuses under DDP."""
    few = dataclasses.replace(TRAIN, val_tokens=TRAIN.seq_len + 1, max_steps=3, checkpoint_every=0)
    one_cfg = RunConfig(model=MODEL, train=few, data=DATA)
    two_cfg = dataclasses.replace(one_cfg, train=dataclasses.replace(few, devices=2, strategy="ddp"))
    one = train(one_cfg, tmp_path / "one", tmp_path / "one.ckpt")
    two = launch(train, 2, two_cfg, tmp_path / "two", tmp_path / "two.ckpt")
    assert two["val_loss"] == pytest.approx(one["val_loss"], rel=1e-4)


def test_a_signal_during_a_steps_first_micro_batch_stops_at_the_next_step(tmp_path: Path) -> None:
    """Saved between micro-batches, the step's accumulated gradient would be lost and the resumed
    run's micro-batches shifted by one; the stop waits for the step's end."""
    from sweep.run.cell import StopOnRequest
    from sweep.signals import Interrupted

    train_cfg = dataclasses.replace(TRAIN, grad_accum=2, checkpoint_every=0)
    cfg = RunConfig(model=MODEL, train=train_cfg, data=DATA)
    with pytest.raises(Interrupted) as stopped:
        Training(cfg, ROOT / ".cache", callbacks=[StopOnRequest(LateSignal(), tmp_path)]).fit()
    assert stopped.value.step == 1 and sorted(p.name for p in tmp_path.iterdir()) == [
        "step000001.ckpt",
        "step000001.ckpt.sha256",
    ]


def test_a_global_batch_that_does_not_split_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    grid = tmp_path / "grid.yaml"
    grid.write_text(MICRO + "  - {id: three, train: {devices: 3}}\n")  # a batch of 4 on 3 devices
    code = main(["sweep", "--grid", str(grid), "--results", str(tmp_path / "results")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err == (
        f"error: {grid}: row 'three': train.batch_size: the global batch 4 does not split into "
        "train.devices x num_nodes x grad_accum = 3 x 1 x 1 = 3 equal batches (at scale 'tiny')"
    )
    assert not (tmp_path / "results").exists()


@GLOO
def test_the_sweep_trains_a_moe_cell_on_two_ranks_as_in_one_process(tmp_path: Path, repo_cache: None) -> None:
    """``train: {devices: 2, strategy: ddp}``: the sweep trains the cell on two gloo ranks; its
    run holds every metric the one-process run holds, each step once, with the same values (but
    throughput), and its final weights."""
    grid_text = MICRO
    two_text = grid_text.replace("max_lr: 2e-3}", "max_lr: 2e-3, devices: 2, strategy: ddp}")
    assert two_text != grid_text
    found = {}
    for name, text in (("one", grid_text), ("two", two_text)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "grid.yaml").write_text(text)
        results = tmp_path / name / "results"
        args = [
            "sweep",
            "--grid",
            str(tmp_path / name / "grid.yaml"),
            "--results",
            str(results),
            "--rows",
            "moe",
        ]
        assert main(args) == 0
        found[name] = histories(results)
    one, two = found["one"], found["two"]
    assert one.keys() == two.keys() and N.TRAIN_LOSS in one and N.VAL_PPL_AVG in one
    # wall-clock figures differ: tokens/s, and the system metrics' sample count (one every 10 s)
    for key in {k for k in one if not k.startswith("system/")} - {N.TRAIN_TOKENS_PER_S}:
        assert [s for s, _ in two[key]] == [s for s, _ in one[key]], key
        assert [v for _, v in two[key]] == pytest.approx([v for _, v in one[key]], rel=1e-4, abs=1e-6), key
    finals = [next((tmp_path / n / "results" / "checkpoints").glob("*/*/final.ckpt")) for n in ("one", "two")]
    assert_close(weights(finals[1]), weights(finals[0]))


@GLOO
def test_sigterm_to_a_two_rank_cell_saves_it_killed_and_the_next_sweep_resumes_it(
    tmp_path: Path, repo_cache: None
) -> None:
    """SIGTERM to the sweep and its ranks (a process group, as SLURM signals a job): the ranks
    stop at one step and save it, the run is ``killed`` (exit 143), and the next sweep resumes it
    from that checkpoint, every step logged once."""
    grid = tmp_path / "grid.yaml"
    grid.write_text(
        LONG_MICRO.replace("checkpoint_every: 5}", "checkpoint_every: 5, devices: 2, strategy: ddp}")
    )
    results = tmp_path / "results"
    args = ["sweep", "--grid", str(grid), "--results", str(results), "--rows", "baseline"]
    sweep = start_slow_cli(args, new_session=True)
    wait_for_checkpoint(results, 5, [sweep])
    os.killpg(sweep.pid, signal.SIGTERM)
    out = sweep.communicate(timeout=300)[0]
    assert sweep.returncode == 143, out
    (killed,) = [line for line in out.splitlines() if "KILLED: SIGTERM at step" in line] or [out]
    assert "KILLED: SIGTERM at step" in killed, out
    step = int(killed.split("KILLED: SIGTERM at step ")[1].split(";")[0])
    assert 5 <= step < LONG_STEPS and step_checkpoint_name(step) in killed

    again = start_slow_cli(args)
    out = again.communicate(timeout=300)[0]
    assert again.returncode == 0, out
    assert f"(killed) from {step_checkpoint_name(step)}" in out
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    runs = client.search_runs(
        [client.get_experiment_by_name("micro-tiny").experiment_id], "tags.kind = 'cell'"
    )
    assert len(runs) == 1, [(r.info.run_id, r.data.tags.get("status")) for r in runs]
    run = runs[0]
    assert (run.data.tags["status"], run.data.tags["resumed"]) == ("finished", "1")
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, N.TRAIN_LOSS))
    assert steps == list(range(LONG_STEPS))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_ranks_die_with_the_process_that_started_them() -> None:
    """A sweep worker killed with ``kill -9`` leaves no rank training on behind it: its torchrun
    gets SIGTERM from the kernel and ends its ranks."""
    code = "import time\nfrom sweep.run.ranks import launch\nlaunch(time.sleep, 2, 600)"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 120
        while len(ranks := ranks_of(parent.pid)) < 2:
            assert parent.poll() is None and time.monotonic() < deadline, "the ranks never started"
            time.sleep(0.05)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 60
    while any(process_state(pid) not in (None, "Z") for pid in ranks):  # gone, or dead and awaiting reaping
        assert time.monotonic() < deadline, f"ranks still running: {[(p, process_state(p)) for p in ranks]}"
        time.sleep(0.05)


@GLOO
def test_a_cell_that_diverges_on_two_ranks_is_recorded_as_diverged(tmp_path: Path, repo_cache: None) -> None:
    """Both ranks stop at the same step (they judge the global loss); the sweep records the cell
    as diverged at that step, as in one process, not as failed."""
    from mlflow import MlflowClient

    bound = "max_lr: 2e-3, devices: 2, strategy: ddp, diverge_factor: 1.0001}"  # ln V * 1.0001
    (tmp_path / "grid.yaml").write_text(MICRO.replace("max_lr: 2e-3}", bound))
    results = tmp_path / "results"
    main(["sweep", "--grid", str(tmp_path / "grid.yaml"), "--results", str(results), "--rows", "baseline"])
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    exp = client.get_experiment_by_name("micro-tiny")
    (run,) = client.search_runs([exp.experiment_id], "tags.kind = 'cell'")
    assert run.data.tags["status"] == "diverged"
    assert run.data.metrics["stability/diverged_step"] == 0
