"""The harness's training loop (Lightning, the MLflow logger, the sweep's callbacks) against the
bare loop of :mod:`tools.throughput.bare` on the same model, alternately, one process."""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

import lightning.pytorch as pl
from mlflow import MlflowClient

from experiments.config import RunConfig
from experiments.train import Training
from sweep.run.cell import StopOnRequest
from sweep.run.progress import ProgressPrinter, SweepClock
from sweep.run.quiet import quiet_lightning
from sweep.run.resume import FlushBeforeCheckpoint, ResumingMLFlowLogger
from sweep.signals import StopRequest
from sweep.store import user_tracking_env
from tools.throughput.bare import setup, step, sync


class StepClock(pl.Callback):
    """The wall time at the start of every training step (so a step's logging and callbacks count)."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        sync()
        self.starts.append(time.perf_counter())


def harness_seconds(cfg: RunConfig, steps: int, skip: int, store: Path, cache_root: Path | None) -> float:
    """Seconds per step of the sweep's own loop (steps ``skip`` .. ``steps - 1``; no validation or
    checkpoint falls inside) logging to a fresh run of the MLflow store at ``store``."""
    t = dataclasses.replace(cfg.train, max_steps=steps, val_every=steps, checkpoint_every=0, warmup_steps=1)
    cfg = dataclasses.replace(cfg, train=t)
    uri = f"sqlite:///{store / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("throughput") or client.get_experiment(
        client.create_experiment("throughput", artifact_location=(store / "artifacts").as_uri())
    )
    run_id = client.create_run(experiment.experiment_id).info.run_id
    clock = StepClock()
    with user_tracking_env():
        logger = ResumingMLFlowLogger(experiment_name="throughput", tracking_uri=uri, run_id=run_id)
        callbacks = [
            ProgressPrinter("", SweepClock(1), out=lambda _line: None),
            FlushBeforeCheckpoint(logger),
            StopOnRequest(StopRequest(), store),
            clock,
        ]
        Training(cfg, cache_root, logger=logger, callbacks=callbacks).fit()
    return (clock.starts[-1] - clock.starts[skip]) / (len(clock.starts) - 1 - skip)


def harness_vs_bare(cfg: RunConfig, rounds: int, steps: int, cache_root: Path | None = None) -> list[float]:
    """Per round, the harness's throughput as a share of the bare loop's (1.0: no overhead)."""
    quiet_lightning()
    module, opt, batch = setup(cfg)
    shares = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            harness = harness_seconds(cfg, steps + 3, 3, Path(tmp), cache_root)
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                step(module, opt, batch)
            sync()
            shares.append((time.perf_counter() - start) / steps / harness)
    return shares
