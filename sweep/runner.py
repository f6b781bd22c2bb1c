"""Runs the cells of a grid: skips finished ones, trains the rest, prints progress and a summary."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import MLFlowLogger

from experiments.corpus import build_corpus
from experiments.data import CorpusDataModule
from experiments.lit import LMModule, auto_precision
from experiments.model import parameter_count
from experiments.probes import probe_batch
from experiments.stability import Diverged
from sweep.grid import Cell, Grid
from sweep.progress import ProgressPrinter, SweepClock
from sweep.tracking import (
    DONE_STATUSES,
    STATUS_DIVERGED,
    STATUS_FAILED,
    STATUS_FINISHED,
    STATUS_RUNNING,
    STATUS_SUPERSEDED,
    Tracker,
    experiment_name,
    tracking_uri,
)

TRAINED, SKIPPED, UNSUPPORTED, DIVERGED, FAILED = "trained", "skipped", "unsupported", "diverged", "failed"
FINAL_CHECKPOINT = "final.ckpt"


@dataclass
class Outcome:
    """What happened to one cell in this sweep."""

    cell: Cell
    status: str
    seconds: float = 0.0
    note: str = ""


def quiet_lightning() -> None:
    """Keep Lightning's banner lines and small-data warnings out of the sweep's log."""
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when mlflow is imported
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*to avoid cluttering logs.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")
    warnings.filterwarnings("ignore", ".*isinstance.treespec, LeafSpec.*")


def checkpoint_dir(results_dir: Path, experiment: str, run_id: str) -> Path:
    """Where one run's checkpoints live: ``results/checkpoints/<experiment>/<run_id>/``.

    Per run, not per cell: a FORCE retrain never touches the checkpoint of the result it may
    replace."""
    return results_dir / "checkpoints" / experiment / run_id


def train_cell(
    cell: Cell,
    tracker: Tracker,
    run_id: str,
    baseline_params: int,
    progress: ProgressPrinter,
    cache_root: Path | None,
    checkpoints: Path,
    extra_callbacks: list[pl.Callback] | None = None,
) -> dict[str, float]:
    """Train one cell into MLflow run ``run_id``, probe it, and return its final metrics.

    Logs ``params/total`` and ``params/added`` (against the grid's baseline row at this scale),
    ``stability/loss_spikes`` with a ``stability.json`` artifact (the spike steps), and the
    probes of ``experiments.probes`` (metrics at the last step, ``probes/`` artifacts) beside
    what :class:`LMModule` logs during training. The training state is checkpointed every
    ``train.checkpoint_every`` steps into ``checkpoints`` (the latest kept); a finished cell
    leaves only the final weights, ``final.ckpt``, saved before probing. A probe that fails
    (out of memory, say) leaves a finished run without probe metrics and a ``probe_error`` tag.

    ``extra_callbacks`` join the trainer's (the LR search's pruning callback, say); whatever
    they raise ends the cell and propagates.

    Raises:
        Diverged: the loss diverged; the last periodic checkpoint stays in ``checkpoints``.
    """
    cfg = cell.config
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    datamodule = CorpusDataModule(cfg.data, cfg.train, cfg.seed, cache_root)
    datamodule.setup()
    probe_tokens, probe_record = probe_batch(datamodule.corpus, cfg.train.seq_len, cfg.train.probe_seqs)
    tracker.log_json(run_id, probe_record, "probe_batch.json")
    tracker.client.set_tag(run_id, "probe_sha256", probe_record["sha256"])
    module = LMModule(cfg, datamodule.domains, probe_tokens)
    logger = MLFlowLogger(experiment_name=tracker.experiment, tracking_uri=tracker.uri, run_id=run_id)
    callbacks: list[pl.Callback] = [progress, *(extra_callbacks or [])]
    if cfg.train.checkpoint_every:
        callbacks.append(
            ModelCheckpoint(
                dirpath=checkpoints,
                filename="step{step:06d}",
                auto_insert_metric_name=False,
                every_n_train_steps=cfg.train.checkpoint_every,
                save_top_k=1,  # with no monitored metric: the latest only
            )
        )
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=cfg.train.max_steps,
        precision=auto_precision(cfg.train.precision),
        gradient_clip_val=cfg.train.grad_clip or None,
        val_check_interval=min(cfg.train.val_every, cfg.train.max_steps),
        num_sanity_val_steps=0,
        log_every_n_steps=cfg.train.log_every,
        logger=logger,
        callbacks=callbacks,
        enable_checkpointing=bool(cfg.train.checkpoint_every),
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:  # diverged or not, the spikes seen so far are data
        spikes = module.spikes.spikes
        tracker.log_metrics(run_id, {"stability/loss_spikes": len(spikes)}, step=trainer.global_step)
        rule = {
            "window": cfg.train.spike_window,
            "z": cfg.train.spike_z,
            "diverge_bound": module.diverge_bound,
        }
        tracker.log_json(
            run_id, {"rule": rule, "spikes": [{"step": s, "loss": v} for s, v in spikes]}, "stability.json"
        )
    if module.last_val_step != trainer.global_step:  # the last validation did not fall on the last step
        trainer.validate(module, datamodule=datamodule, verbose=False)
    final = dict(module.last_val)
    final["params/total"] = module.n_params
    final["params/added"] = module.n_params - baseline_params
    tracker.log_metrics(run_id, {k: final[k] for k in ("params/total", "params/added")})
    trainer.save_checkpoint(checkpoints / FINAL_CHECKPOINT, weights_only=True)
    for old in checkpoints.glob("step*.ckpt"):
        old.unlink()  # the run is done: only its final weights are kept
    tracker.client.set_tag(run_id, "checkpoint", str(checkpoints / FINAL_CHECKPOINT))
    module.to(trainer.strategy.root_device)  # Lightning's teardown moved it to the CPU
    try:
        probes = module.probe()
    except (RuntimeError, ValueError) as err:  # torch reports out-of-memory as a RuntimeError
        tracker.client.set_tag(run_id, "probe_error", f"{type(err).__name__}: {err}"[:5000])
        return final
    tracker.log_metrics(run_id, probes.metrics(), step=trainer.global_step)
    with tempfile.TemporaryDirectory() as tmp:
        tracker.log_files(run_id, probes.save(Path(tmp)), "probes")
    final.update(probes.summary)
    return final


def run_sweep(
    grid: Grid,
    cells: list[Cell],
    results_dir: Path,
    force: bool = False,
    cache_root: Path | None = None,
    out=print,
) -> list[Outcome]:
    """Train every cell that has no finished run, in order; never raises for one cell's failure.

    Args:
        grid: the parsed grid (for the experiment name and the baseline's parameter count).
        cells: the cells to consider, from ``grid.cells(...)``.
        results_dir: holds the default SQLite store and artifacts.
        force: retrain cells that already finished (their old run is tagged ``superseded``).
        cache_root: corpus cache (default ``.cache``).
        out: where progress lines go.

    Returns:
        One :class:`Outcome` per cell, in order.
    """
    quiet_lightning()
    scale = cells[0].scale
    tracker = Tracker(
        tracking_uri(results_dir), experiment_name(grid.name, scale), results_dir / "mlartifacts"
    )
    baseline_params = parameter_count(grid.baseline_config(scale).model)
    for data_cfg in {c.config.data for c in cells if not c.unsupported}:
        build_corpus(data_cfg, cache_root, log=out)

    todo, outcomes = [], {}
    for cell in cells:
        if cell.unsupported:
            outcomes[id(cell)] = Outcome(cell, UNSUPPORTED, note=cell.unsupported)
            continue
        done = tracker.done_run(cell.run_key)
        if done is not None and not force:
            outcomes[id(cell)] = Outcome(cell, SKIPPED, note=f"{done.data.tags['status']} earlier")
            continue
        todo.append(cell)
    out(
        f"sweep {grid.name} at scale {scale}: {len(cells)} cells, {len(todo)} to train, "
        f"{sum(o.status == SKIPPED for o in outcomes.values())} finished earlier, "
        f"{sum(o.status == UNSUPPORTED for o in outcomes.values())} unsupported; tracking {tracker.uri}"
    )

    clock = SweepClock(len(todo))
    for i, cell in enumerate(todo, start=1):
        earlier = tracker.runs_for(cell.run_key)
        for old in earlier:
            if old.data.tags.get("status") in (STATUS_FAILED, STATUS_RUNNING):
                tracker.delete(old.info.run_id)  # an attempt that died: start the cell afresh
                shutil.rmtree(checkpoint_dir(results_dir, tracker.experiment, old.info.run_id), True)
        prefix = f"[{i:>{len(str(len(todo)))}}/{len(todo)}] {cell.row.id} s{cell.seed}"
        run_id = tracker.start_cell(cell)
        started = time.perf_counter()
        checkpoints = checkpoint_dir(results_dir, tracker.experiment, run_id)
        try:
            final = train_cell(
                cell,
                tracker,
                run_id,
                baseline_params,
                ProgressPrinter(prefix, clock, out),
                cache_root,
                checkpoints,
            )
        except Diverged as err:  # a result, as Table 2's "-" rows: recorded, and the sweep goes on
            kept = sorted(checkpoints.glob("step*.ckpt"))
            if kept:
                tracker.client.set_tag(run_id, "checkpoint", str(kept[-1]))
            tracker.log_metrics(run_id, {"stability/diverged_step": err.step}, step=err.step)
            tracker.finish(run_id, STATUS_DIVERGED, str(err))
            outcomes[id(cell)] = Outcome(cell, DIVERGED, time.perf_counter() - started, note=str(err))
            where = f"; last good checkpoint {kept[-1]}" if kept else "; no checkpoint yet"
            out(f"{prefix} DIVERGED: {err}{where}")
            clock.cell_done(time.perf_counter() - started)
            continue
        except Exception as err:  # one bad cell must not stop the sweep
            tracker.finish(run_id, STATUS_FAILED, f"{type(err).__name__}: {err}")
            outcomes[id(cell)] = Outcome(
                cell, FAILED, time.perf_counter() - started, note=f"{type(err).__name__}: {err}"
            )
            out(f"{prefix} FAILED: {type(err).__name__}: {err}")
            clock.cell_done(time.perf_counter() - started)
            continue
        seconds = time.perf_counter() - started
        tracker.finish(run_id, STATUS_FINISHED)
        for old in earlier:  # FORCE: the old result steps aside only once the new one exists
            if old.data.tags.get("status") in DONE_STATUSES:
                tracker.client.set_tag(old.info.run_id, "status", STATUS_SUPERSEDED)
        clock.cell_done(seconds)
        outcomes[id(cell)] = Outcome(cell, TRAINED, seconds)
        domains = ", ".join(
            f"{key.removeprefix('val/ppl/')} {value:.2f}"
            for key, value in final.items()
            if key.startswith("val/ppl/") and key != "val/ppl/avg"
        )
        probes = "probes failed (tag probe_error)"
        if "sink/first_token_attn" in final:
            probes = f"F-Attn {final['sink/first_token_attn']:.3f}, M-Act {final['act/max_mean']:.1f}"
        if "gate/score_mean" in final:
            probes += f", gate score {final['gate/score_mean']:.3f}"
        out(f"{prefix} done in {seconds:.0f} s: Avg PPL {final['val/ppl/avg']:.2f} ({domains}); {probes}")
    return [outcomes[id(c)] for c in cells]


def summary_line(outcomes: list[Outcome]) -> str:
    """``trained 13, skipped 0, unsupported 1, diverged 0, failed 0``."""
    counts = {
        s: sum(o.status == s for o in outcomes) for s in (TRAINED, SKIPPED, UNSUPPORTED, DIVERGED, FAILED)
    }
    return ", ".join(f"{k} {v}" for k, v in counts.items())
