"""One cell of a sweep: the sweep prepared (store, corpora, experiment), the cell's run claimed (a
new one, or its unfinished one resumed), trained and recorded (:class:`CellResult`)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException

from experiments import names as N
from experiments.checkpointing import checkpoint_problem, drop_step_checkpoints, latest_checkpoint, sum_file
from experiments.corpus import build_corpus
from experiments.names import Outcome, Status
from experiments.stability import Diverged
from sweep.fingerprints import expect_corpus
from sweep.grid import Cell, Grid
from sweep.run.cell import StopOnRequest, checkpoint_dir, train_on_ranks
from sweep.run.corpora import check_fits, check_sources
from sweep.run.placement import check_runnable, placement_change
from sweep.run.progress import ProgressPrinter, SweepClock
from sweep.run.quiet import pin_threads, quiet_lightning
from sweep.run.ranks import end_orphan_ranks
from sweep.run.resume import WORKER_TAG, logged_steps, worker_name
from sweep.run.stages import Stage, parent_stage
from sweep.run.sysmetrics import system_metrics
from sweep.signals import Interrupted, StopRequest
from sweep.store import Tracker, experiment_name
from sweep.store_urls import TrackingError, check_reachable, tracking_uri


@dataclass
class CellResult:
    """What happened to one cell in this sweep; ``status`` is an :class:`~experiments.names.Outcome`."""

    cell: Cell
    status: str
    seconds: float = 0.0
    note: str = ""
    avg_ppl: float | None = None  # the final validation Avg PPL of a cell trained to the end


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
    nodes: int | None = 1,
    default_queue: bool = False,
) -> SweepContext:
    """Check the tracking store answers, build the corpora, then create (or restore) the experiment.

    In that order, so that an unreachable store or a corpus that cannot be built stops the sweep
    before any run (or experiment) exists. ``default_queue``: the sweep's queue is the results
    folder's own ``optuna.db`` (no ``STORAGE`` given), which no other machine reaches.

    Raises:
        GridError: a cell's machines do not fit ``nodes`` (:func:`check_runnable`).
        TrackingError: the store is unreachable or unusable, or it is a store other machines
            may sweep into while the queue is ``default_queue`` (:func:`check_one_queue`).
        CorpusError: a corpus source cannot be built.
    """
    check_runnable(grid, cells, nodes)
    quiet_lightning()
    pin_threads()
    scale = cells[0].scale
    uri = tracking_uri(results_dir)
    recipes = list(dict.fromkeys(c.config.data for c in cells))
    for data_cfg in recipes:  # before the store: an offline hub source or a missing file writes nothing
        check_sources(data_cfg)
    check_reachable(uri)
    if default_queue:
        check_one_queue(uri, results_dir)
    corpora = [build_corpus(data_cfg, cache_root, log=out) for data_cfg in recipes]
    for data_cfg, corpus in zip(recipes, corpora):
        check_fits(grid, [c for c in cells if c.config.data == data_cfg], corpus)
    tracker = Tracker(uri, experiment_name(grid.name, scale), results_dir / "mlartifacts", out)
    for corpus in corpora:  # runs on other bytes (a source rewritten since) are no results
        expect_corpus(tracker, corpus)
    return SweepContext(grid, tracker, results_dir, cache_root, stop or StopRequest(), out)


def check_one_queue(uri: str, results_dir: Path) -> None:
    """Refuse a tracking store that other machines may sweep into (a server, a database) with the
    results folder's own queue: every sweep into one store must take its cells from one queue,
    which alone knows whether a ``running`` run's worker is alive; with two, each would take over
    the other's running cells.

    Raises:
        TrackingError: ``uri`` is neither a SQLite file nor a file store; one line.
    """
    local_file = uri.startswith(("sqlite:", "file:")) or ("://" not in uri and uri != "databricks")
    if local_file:  # a SQLite file, a file store, or a bare path (MLflow's file store)
        return
    raise TrackingError(
        f"tracking store {uri} may take sweeps from other machines, and every sweep into one store "
        "must share its queue: give STORAGE=<a database they all reach> (docs/cluster.md), or "
        f"STORAGE=sqlite:///{(results_dir / 'optuna.db').resolve()} if this machine alone sweeps into it"
    )


@dataclass
class Claim:
    """The run a cell trains in now, and where it starts from."""

    run_id: str
    checkpoints: Path
    resume_from: Path | None = None  # a step<N>.ckpt of an earlier attempt, in the same run
    replayed: dict[str, int] | None = None  # metric -> highest step the run already holds
    restarted: bool = False  # an earlier attempt left nothing to continue: a new run from step 0
    start_weights: Path | None = None  # a later stage's parent's final.ckpt (used from step 0 only)


def claim_run(
    cell: Cell, ctx: SweepContext, unfinished: Any | None, prefix: str, stage: Stage | None = None
) -> Claim:
    """The run this process trains the cell in: ``unfinished`` (a run nobody trains now: the queue
    handed the cell to this worker) continued from its newest usable checkpoint, or a new run.

    An unfinished run with no usable checkpoint (it died before its first, a write failed, its
    folder was deleted by hand, the file is truncated) is deleted with its folder, and the cell
    starts over in a new run; a line says why. A later ``stage`` starts a new run from its
    parent's weights, linked to the parent's run by tags.
    """
    tracker, out = ctx.tracker, ctx.out
    weights, stage_tags = (stage.weights, stage.tags) if stage is not None else (None, {})

    def new_run(restarted: bool = False) -> Claim:
        run_id = tracker.start_cell(cell, {WORKER_TAG: worker_name(), **stage_tags})
        folder = checkpoint_dir(ctx.results_dir, tracker.experiment, run_id)
        return Claim(run_id, folder, restarted=restarted, start_weights=weights)

    if unfinished is None:
        return new_run()
    old_id, old_status = unfinished.info.run_id, unfinished.data.tags.get("status")
    checkpoints = checkpoint_dir(ctx.results_dir, tracker.experiment_name_of(unfinished), old_id)
    resume_from = latest_checkpoint(checkpoints)
    why = f"no checkpoint in {checkpoints}" if checkpoints.is_dir() else f"no folder {checkpoints}"
    if resume_from is not None and (problem := checkpoint_problem(resume_from)):
        why, resume_from = f"an unusable checkpoint {resume_from} ({problem})", None
    if resume_from is None:
        tracker.delete(old_id)  # its points belong to a trajectory nobody can continue
        shutil.rmtree(checkpoints, ignore_errors=True)
        claim = new_run(restarted=True)
        out(
            f"{prefix} restarting from step 0 in run {claim.run_id}: "
            f"run {old_id} ({old_status}) has {why}; deleted it"
        )
        return claim
    for stale in checkpoints.glob("step*.ckpt*"):
        if stale not in (resume_from, sum_file(resume_from)):  # a sharded run's are folders
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    replayed = logged_steps(tracker.client, old_id)
    tracker.client.set_tag(old_id, WORKER_TAG, worker_name())
    tracker.reopen(old_id)
    out(f"{prefix} resuming run {old_id} ({old_status}) from {resume_from.name}")
    return Claim(old_id, checkpoints, resume_from, replayed)


def run_cell(
    cell: Cell, ctx: SweepContext, prefix: str, clock: SweepClock, force: bool = False
) -> CellResult:
    """Train one cell the queue handed to this worker to the end, resuming its unfinished run if
    it has one; never raises for the cell's own failure.

    - A cell with a ``finished`` or ``diverged`` run is skipped (unless ``force``).
    - A cell whose newest run is ``running`` (its worker died: the queue gave the cell to this
      one), ``failed`` or ``killed`` continues in that run from its latest ``step<N>.ckpt``;
      metric points the run already holds are not logged again. Without a usable checkpoint the
      cell starts over in a new run (:func:`claim_run`). While the dead worker's torchrun still
      stops its ranks (up to 30 s) the cell waits; ranks still running after 60 s are killed.
    - Otherwise a new run is created.

    While it trains, the machine's load is logged as MLflow system metrics
    (:mod:`sweep.run.sysmetrics`). An experiment deleted in the MLflow UI is restored first
    (:meth:`Tracker.ensure_active`); a run deleted while it trains ends the cell as failed, with a
    line.

    Returns:
        A :class:`CellResult`: finished, resumed (from a checkpoint), restarted (from step 0 after
        an attempt that left none), skipped, diverged, failed or killed (a signal stopped
        it; its state is saved and the next sweep resumes it).

    Raises:
        KeyboardInterrupt, SystemExit: a second Ctrl-C; the run is marked killed first.
        TrackingError: the store is gone or failed (one line), or the experiment was deleted and
            cannot be restored.
    """
    tracker, out = ctx.tracker, ctx.out
    tracker.ensure_active()
    done, unfinished = tracker.current_state(cell)
    if done is not None and not force:
        return CellResult(cell, Outcome.SKIPPED, note=f"{done.data.tags['status']} earlier")
    if unfinished is not None:  # its dead worker's ranks may still be saving (torchrun stops them)
        run_id = unfinished.info.run_id
        folder = checkpoint_dir(ctx.results_dir, tracker.experiment_name_of(unfinished), run_id)
        if killed := end_orphan_ranks(folder):
            out(f"{prefix} killed its dead worker's ranks (pids {', '.join(map(str, killed))}), hung 60 s")
    if unfinished is not None and (moved := placement_change(unfinished, cell)):
        out(f"{prefix} FAILED: {moved}")
        return CellResult(cell, Outcome.FAILED, note=moved)
    stage = parent_stage(cell, tracker, ctx.results_dir) if cell.parent is not None else None
    if isinstance(stage, str):
        out(f"{prefix} FAILED: {stage}; it trains once the parent has finished")
        return CellResult(cell, Outcome.FAILED, note=stage)
    claim = claim_run(cell, ctx, unfinished, prefix, stage)
    run_id = claim.run_id
    started = time.perf_counter()
    with system_metrics(tracker.uri, run_id):
        try:
            return train_claimed(cell, ctx, prefix, clock, claim)
        except MlflowException as err:  # recording failed: the run or the store is gone
            tracker.check_store()
            if not tracker.is_deleted(run_id):
                line = f"tracking store {tracker.uri} failed: {type(err).__name__}: {err}".splitlines()[0]
                raise TrackingError(line) from None
            note = f"its run {run_id} was deleted in the MLflow UI while it trained"
            out(f"{prefix} FAILED: {note}; the next sweep trains the cell again")
            clock.cell_done(time.perf_counter() - started)
            return CellResult(cell, Outcome.FAILED, time.perf_counter() - started, note=note)


def train_claimed(cell: Cell, ctx: SweepContext, prefix: str, clock: SweepClock, claim: Claim) -> CellResult:
    """Train the claimed run and record how it ended (see :func:`run_cell`)."""
    tracker, out, run_id, checkpoints = ctx.tracker, ctx.out, claim.run_id, claim.checkpoints
    earlier = [r for r in tracker.runs_for(cell.run_key) if r.info.run_id != run_id]
    started = time.perf_counter()

    def ended(status: str, note: str = "") -> CellResult:
        clock.cell_done(time.perf_counter() - started)
        return CellResult(cell, status, time.perf_counter() - started, note=note)

    try:
        final = train_on_ranks(
            cell,
            tracker,
            run_id,
            ctx.grid.reference_config(cell.scale, cell.row).model.param_counts()[0],
            ProgressPrinter(prefix, clock, out),
            ctx.cache_root,
            checkpoints,
            extra_callbacks=[StopOnRequest(ctx.stop, checkpoints)],
            resume_from=claim.resume_from,
            replayed=claim.replayed,
            start_weights=claim.start_weights,
        )
    except Interrupted as err:
        if err.checkpoint is not None:
            tracker.client.set_tag(run_id, "checkpoint", str(err.checkpoint))
        tracker.finish(run_id, Status.KILLED, str(err))
        out(f"{prefix} KILLED: {err}; the next sweep resumes it")
        return ended(Outcome.KILLED, str(err))
    except Diverged as err:  # a result, as Table 2's "-" rows: recorded, and the sweep goes on
        kept = latest_checkpoint(checkpoints)
        if kept:
            tracker.client.set_tag(run_id, "checkpoint", str(kept))
        tracker.log_metrics(run_id, {N.DIVERGED_STEP: err.step}, step=err.step)
        tracker.finish(run_id, Status.DIVERGED, str(err))
        where = f"; last good checkpoint {kept}" if kept else "; no checkpoint yet"
        out(f"{prefix} DIVERGED: {err}{where}")
        return ended(Outcome.DIVERGED, str(err))
    except Exception as err:  # one bad cell must not stop the sweep
        note = f"{type(err).__name__}: {err}"
        kept = latest_checkpoint(checkpoints)
        if kept:
            tracker.client.set_tag(run_id, "checkpoint", str(kept))
        tracker.finish(run_id, Status.FAILED, note)
        out(f"{prefix} FAILED: {note}")
        return ended(Outcome.FAILED, note)
    except BaseException:  # a second Ctrl-C (KeyboardInterrupt, or Lightning's SystemExit for it)
        tracker.finish(run_id, Status.KILLED, "interrupted twice: resumes from the last periodic checkpoint")
        raise
    tracker.finish(run_id, Status.FINISHED)
    drop_step_checkpoints(checkpoints)  # the result is recorded: only final.ckpt is kept
    for old in earlier:  # FORCE: the old result steps aside only once the new one exists
        if old.data.tags.get("status") in Status.DONE:
            tracker.client.set_tag(old.info.run_id, "status", Status.SUPERSEDED)
    how = Outcome.RESUMED if claim.resume_from else Outcome.RESTARTED if claim.restarted else Outcome.FINISHED
    outcome = ended(how)
    outcome.avg_ppl = final[N.VAL_PPL_AVG]
    domains = ", ".join(f"{N.domain_of(k)} {v:.2f}" for k, v in final.items() if N.domain_of(k))
    probes = "probes failed (tag probe_error)"
    if N.F_ATTN in final:
        probes = f"F-Attn {final[N.F_ATTN]:.3f}, M-Act {final[N.M_ACT]:.1f}"
    if N.GATE_SCORE_MEAN in final:
        probes += f", gate score {final[N.GATE_SCORE_MEAN]:.3f}"
    out(f"{prefix} done in {outcome.seconds:.0f} s: Avg PPL {outcome.avg_ppl:.2f} ({domains}); {probes}")
    return outcome
