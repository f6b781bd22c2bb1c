"""Runs the cells of a grid: skips finished ones, trains the rest, prints progress and a summary."""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from experiments.corpus import build_corpus
from experiments.data import CorpusDataModule
from experiments.lit import LMModule, auto_precision
from experiments.model import parameter_count
from experiments.probes import probe_batch
from experiments.stability import Diverged
from sweep.grid import Cell, Grid
from sweep.interrupt import Interrupted, StopOnRequest, StopRequest
from sweep.progress import ProgressPrinter, SweepClock
from sweep.resume import (
    AtomicCheckpointIO,
    PeriodicCheckpoint,
    ResumingMLFlowLogger,
    drop_step_checkpoints,
    latest_checkpoint,
    logged_steps,
)
from sweep.tracking import (
    DONE_STATUSES,
    STATUS_DIVERGED,
    STATUS_FAILED,
    STATUS_FINISHED,
    STATUS_KILLED,
    STATUS_RUNNING,
    STATUS_SUPERSEDED,
    Tracker,
    check_reachable,
    experiment_name,
    tracking_uri,
)

FINISHED, RESUMED, SKIPPED, UNSUPPORTED = "finished", "resumed", "skipped", "unsupported"
DIVERGED, FAILED, KILLED = "diverged", "failed", "killed"
OUTCOMES = (FINISHED, RESUMED, SKIPPED, UNSUPPORTED, DIVERGED, FAILED, KILLED)
FINAL_CHECKPOINT = "final.ckpt"


@dataclass
class Outcome:
    """What happened to one cell in this sweep."""

    cell: Cell
    status: str
    seconds: float = 0.0
    note: str = ""
    avg_ppl: float | None = None  # the final validation Avg PPL of a cell trained to the end


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
    warnings.filterwarnings("ignore", ".*resuming from a checkpoint that ended before the epoch ended.*")


def worker_name() -> str:
    """``host:pid``: which process trains a cell (MLflow tag and queue trial attribute ``worker``)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def live_owner(run: Any) -> str | None:
    """The ``worker`` tag of a ``running`` run whose process is alive on this machine, else None.
    (A process on another machine cannot be checked; the queue's heartbeats cover that case.)"""
    owner = run.data.tags.get("worker", "")
    host, _, pid = owner.rpartition(":")
    if run.data.tags.get("status") != STATUS_RUNNING or host != socket.gethostname() or not pid.isdigit():
        return None
    if int(pid) == os.getpid():
        return None
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        return owner
    return owner


def checkpoint_dir(results_dir: Path, experiment: str, run_id: str) -> Path:
    """Where one run's checkpoints live: ``results/checkpoints/<experiment>/<run_id>/``.

    Per run, not per cell: a FORCE retrain never touches the checkpoint of the result it may
    replace."""
    return results_dir / "checkpoints" / experiment / run_id


def train_cell(
    cell: Cell,
    tracker: Tracker,
    run_id: str,
    reference_params: int,
    progress: ProgressPrinter,
    cache_root: Path | None,
    checkpoints: Path,
    extra_callbacks: list[pl.Callback] | None = None,
    resume_from: Path | None = None,
    replayed: dict[str, int] | None = None,
) -> dict[str, float]:
    """Train one cell into MLflow run ``run_id``, probe it, and return its final metrics.

    Logs ``params/total``, ``params/active`` (what one token uses: MoE experts not chosen
    excluded; the total for a dense model) and ``params/added`` (total against the row's
    reference, :meth:`Grid.reference`, at this scale),
    ``stability/loss_spikes`` with a ``stability.json`` artifact (the spike steps), and the
    probes of ``experiments.probes`` (metrics at the last step, ``probes/`` artifacts) beside
    what :class:`LMModule` logs during training. The training state is checkpointed every
    ``train.checkpoint_every`` steps into ``checkpoints`` (the latest kept); a finished cell
    also gets its final weights, ``final.ckpt``, saved before probing; the caller removes the
    step files once the result is recorded (:func:`sweep.resume.drop_step_checkpoints`). A probe that fails
    (out of memory, say) leaves a finished run without probe metrics and a ``probe_error`` tag.

    ``extra_callbacks`` join the trainer's (the LR search's pruning callback, say); whatever
    they raise ends the cell and propagates.

    ``resume_from`` continues from a training checkpoint (``step<N>.ckpt``) with the state it
    holds; ``replayed`` (metric key -> highest step already in the run) keeps the replayed steps
    from being logged twice.

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
    logger = ResumingMLFlowLogger(
        replayed, experiment_name=tracker.experiment, tracking_uri=tracker.uri, run_id=run_id
    )
    callbacks: list[pl.Callback] = [progress, *(extra_callbacks or [])]
    if cfg.train.checkpoint_every:
        callbacks.append(PeriodicCheckpoint(checkpoints, cfg.train.checkpoint_every))
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
        enable_checkpointing=False,  # PeriodicCheckpoint instead of ModelCheckpoint
        plugins=[AtomicCheckpointIO()],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resume_from, weights_only=False)
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
    final["params/active"] = module.n_active_params
    final["params/added"] = module.n_params - reference_params
    tracker.log_metrics(run_id, {k: final[k] for k in ("params/total", "params/active", "params/added")})
    trainer.save_checkpoint(checkpoints / FINAL_CHECKPOINT, weights_only=True)
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


@dataclass
class SweepContext:
    """What every cell of one sweep (or one queue worker) shares."""

    grid: Grid
    tracker: Tracker
    results_dir: Path
    cache_root: Path | None
    stop: StopRequest
    out: Callable[[str], None] = print


def prepare_sweep(
    grid: Grid,
    cells: list[Cell],
    results_dir: Path,
    cache_root: Path | None = None,
    stop: StopRequest | None = None,
    out: Callable[[str], None] = print,
) -> SweepContext:
    """Check the tracking store answers, build the corpora, then create the experiment.

    In that order, so that an unreachable store or a corpus that cannot be built stops the sweep
    before any run (or experiment) exists.

    Raises:
        TrackingError: the store is unreachable or unusable.
        CorpusError: a corpus source cannot be built.
    """
    quiet_lightning()
    scale = cells[0].scale
    uri = tracking_uri(results_dir)
    check_reachable(uri)
    for data_cfg in {c.config.data for c in cells if not c.unsupported}:
        build_corpus(data_cfg, cache_root, log=out)
    tracker = Tracker(uri, experiment_name(grid.name, scale), results_dir / "mlartifacts")
    return SweepContext(grid, tracker, results_dir, cache_root, stop or StopRequest(), out)


def run_cell(cell: Cell, ctx: SweepContext, prefix: str, clock: SweepClock, force: bool = False) -> Outcome:
    """Train one cell to the end, resuming its unfinished run if it has one; never raises for the
    cell's own failure.

    - A cell with a ``finished`` or ``diverged`` run is skipped (unless ``force``).
    - A cell whose newest run is ``running`` (its process died), ``failed`` or ``killed``
      continues in that run from its latest ``step<N>.ckpt``; metric points the run already
      holds are not logged again. Without a checkpoint that run is deleted and the cell starts
      over in a new one (its points belong to a trajectory nobody can continue).
    - A ``running`` run whose ``worker`` tag names a live process on this machine is left alone
      (skipped): two sweeps on one store without the queue.
    - Otherwise a new run is created.

    Returns:
        An :class:`Outcome`: finished, resumed, skipped, diverged, failed or killed (a signal
        stopped it; its state is saved and the next sweep resumes it).

    Raises:
        KeyboardInterrupt, SystemExit: a second Ctrl-C; the run is marked killed first.
    """
    tracker, out = ctx.tracker, ctx.out
    done = tracker.done_run(cell.run_key)
    if done is not None and not force:
        return Outcome(cell, SKIPPED, note=f"{done.data.tags['status']} earlier")
    unfinished = tracker.resumable_run(cell.run_key)
    if unfinished is not None and (owner := live_owner(unfinished)):
        return Outcome(cell, SKIPPED, note=f"being trained by {owner}")
    resume_from, replayed = None, {}
    if unfinished is not None:
        checkpoints = checkpoint_dir(ctx.results_dir, tracker.experiment, unfinished.info.run_id)
        resume_from = latest_checkpoint(checkpoints)
    if resume_from is not None:
        run_id = unfinished.info.run_id
        for stale in checkpoints.glob("step*.ckpt*"):
            if stale != resume_from:
                stale.unlink()
        replayed = logged_steps(tracker.client, run_id)
        tracker.reopen(run_id)
        out(f"{prefix} resuming run {run_id} ({unfinished.data.tags.get('status')}) from {resume_from.name}")
    else:
        if unfinished is not None:  # died before its first checkpoint: its points cannot be continued
            tracker.delete(unfinished.info.run_id)
            out(f"{prefix} restarting: run {unfinished.info.run_id} died before its first checkpoint")
        run_id = tracker.start_cell(cell)
        checkpoints = checkpoint_dir(ctx.results_dir, tracker.experiment, run_id)
    tracker.client.set_tag(run_id, "worker", worker_name())
    earlier = [r for r in tracker.runs_for(cell.run_key) if r.info.run_id != run_id]
    started = time.perf_counter()

    def ended(status: str, note: str = "") -> Outcome:
        clock.cell_done(time.perf_counter() - started)
        return Outcome(cell, status, time.perf_counter() - started, note=note)

    try:
        final = train_cell(
            cell,
            tracker,
            run_id,
            parameter_count(ctx.grid.reference_config(cell.scale, cell.row).model),
            ProgressPrinter(prefix, clock, out),
            ctx.cache_root,
            checkpoints,
            extra_callbacks=[StopOnRequest(ctx.stop, checkpoints)],
            resume_from=resume_from,
            replayed=replayed,
        )
    except Interrupted as err:
        tracker.client.set_tag(run_id, "checkpoint", str(err.checkpoint))
        tracker.finish(run_id, STATUS_KILLED, str(err))
        out(f"{prefix} KILLED: {err}; the next sweep resumes it")
        return ended(KILLED, str(err))
    except Diverged as err:  # a result, as Table 2's "-" rows: recorded, and the sweep goes on
        kept = latest_checkpoint(checkpoints)
        if kept:
            tracker.client.set_tag(run_id, "checkpoint", str(kept))
        tracker.log_metrics(run_id, {"stability/diverged_step": err.step}, step=err.step)
        tracker.finish(run_id, STATUS_DIVERGED, str(err))
        where = f"; last good checkpoint {kept}" if kept else "; no checkpoint yet"
        out(f"{prefix} DIVERGED: {err}{where}")
        return ended(DIVERGED, str(err))
    except Exception as err:  # one bad cell must not stop the sweep
        note = f"{type(err).__name__}: {err}"
        kept = latest_checkpoint(checkpoints)
        if kept:
            tracker.client.set_tag(run_id, "checkpoint", str(kept))
        tracker.finish(run_id, STATUS_FAILED, note)
        out(f"{prefix} FAILED: {note}")
        return ended(FAILED, note)
    except BaseException:  # a second Ctrl-C (KeyboardInterrupt, or Lightning's SystemExit for it)
        tracker.finish(run_id, STATUS_KILLED, "interrupted twice: resumes from the last periodic checkpoint")
        raise
    tracker.finish(run_id, STATUS_FINISHED)
    drop_step_checkpoints(checkpoints)  # the result is recorded: only final.ckpt is kept
    for old in earlier:  # FORCE: the old result steps aside only once the new one exists
        if old.data.tags.get("status") in DONE_STATUSES:
            tracker.client.set_tag(old.info.run_id, "status", STATUS_SUPERSEDED)
    outcome = ended(RESUMED if unfinished is not None else FINISHED)
    outcome.avg_ppl = final["val/ppl/avg"]
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
    out(f"{prefix} done in {outcome.seconds:.0f} s: Avg PPL {final['val/ppl/avg']:.2f} ({domains}); {probes}")
    return outcome


def run_sweep(
    grid: Grid,
    cells: list[Cell],
    results_dir: Path,
    force: bool = False,
    cache_root: Path | None = None,
    out: Callable[[str], None] = print,
    stop: StopRequest | None = None,
) -> list[Outcome]:
    """Train every cell that has no result, in order, in this process; never raises for one
    cell's failure. With an active ``stop`` (see :mod:`sweep.interrupt`), Ctrl-C or SIGTERM
    stops the sweep after saving the current cell's state; the cells not reached are reported
    as ``killed`` too.

    Args:
        grid: the parsed grid (for the experiment name and the baseline's parameter count).
        cells: the cells to consider, from ``grid.cells(...)``.
        results_dir: holds the default SQLite store, artifacts and checkpoints.
        force: retrain cells that already finished (their old run is tagged ``superseded``).
        cache_root: corpus cache (default ``.cache``).
        out: where progress lines go.
        stop: the signal catcher the caller entered (none: signals act as usual).

    Returns:
        One :class:`Outcome` per cell, in order.

    Raises:
        TrackingError, CorpusError: before any run exists (see :func:`prepare_sweep`).
    """
    ctx = prepare_sweep(grid, cells, results_dir, cache_root, stop, out)
    ctx.stop.arm()
    runnable = [c for c in cells if not c.unsupported]
    todo = [c for c in runnable if force or ctx.tracker.done_run(c.run_key) is None]
    out(
        f"sweep {grid.name} at scale {cells[0].scale}: {len(cells)} cells, {len(todo)} to train, "
        f"{len(runnable) - len(todo)} finished earlier, {len(cells) - len(runnable)} unsupported; "
        f"tracking {ctx.tracker.uri}"
    )
    outcomes: dict[int, Outcome] = {}
    clock = SweepClock(len(todo))
    for i, cell in enumerate(todo, start=1):
        if ctx.stop.signum is not None:
            outcomes[id(cell)] = Outcome(cell, KILLED, note="not started: the sweep was interrupted")
            continue
        prefix = f"[{i:>{len(str(len(todo)))}}/{len(todo)}] {cell.row.id} s{cell.seed}"
        outcomes[id(cell)] = run_cell(cell, ctx, prefix, clock, force)
    for cell in cells:
        if id(cell) not in outcomes:
            status = UNSUPPORTED if cell.unsupported else SKIPPED
            outcomes[id(cell)] = Outcome(cell, status, note=cell.unsupported or "finished earlier")
    return [outcomes[id(c)] for c in cells]


def summary_line(outcomes: list[Outcome]) -> str:
    """``finished 12, resumed 1, skipped 0, unsupported 1, diverged 0, failed 0`` (``killed`` if any)."""
    counts = {s: sum(o.status == s for o in outcomes) for s in OUTCOMES}
    return ", ".join(f"{k} {v}" for k, v in counts.items() if k != KILLED or v)
