"""Runs the cells of a grid: skips finished ones, trains the rest, prints progress and a summary."""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from experiments import names as N
from experiments.checkpointing import drop_step_checkpoints, latest_checkpoint
from experiments.corpus import build_corpus
from experiments.names import Outcome, Status
from experiments.stability import Diverged
from sweep.grid import Cell, Grid
from sweep.gridfile import GridError
from sweep.run.cell import checkpoint_dir, train_cell
from sweep.run.interrupt import Interrupted, StopOnRequest, StopRequest
from sweep.run.progress import ProgressPrinter, SweepClock
from sweep.run.resume import live_owner, logged_steps, worker_name
from sweep.store import Tracker, check_reachable, experiment_name, tracking_uri


@dataclass
class CellResult:
    """What happened to one cell in this sweep; ``status`` is an :class:`~experiments.names.Outcome`."""

    cell: Cell
    status: str
    seconds: float = 0.0
    note: str = ""
    avg_ppl: float | None = None  # the final validation Avg PPL of a cell trained to the end


#: Torch threads of every cell on the CPU. Fixed, so a cell's arithmetic, and so its numbers, does
#: not depend on how many workers share the machine: the workers are the parallelism. On 2 cores
#: two one-thread workers trained 1.49x the tokens per second of one two-thread process.
CELL_THREADS = 1


def pin_threads() -> None:
    """Set this process's torch threads to :data:`CELL_THREADS`."""
    torch.set_num_threads(CELL_THREADS)


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


@dataclass
class SweepContext:
    """What every cell of one sweep (or one queue worker) shares."""

    grid: Grid
    tracker: Tracker
    results_dir: Path
    cache_root: Path | None
    stop: StopRequest
    out: Callable[[str], None] = print


def check_runnable(grid: Grid, cells: list[Cell]) -> None:
    """The sweep trains each cell in one process; a cell asking for several is refused up front.

    Raises:
        GridError: naming the row and ``train.devices`` of the first such cell.
    """
    for cell in cells:
        t = cell.config.train
        if t.world_size > 1:
            raise GridError(
                grid.file,
                f"devices x num_nodes = {t.world_size}: the sweep trains a cell in one process for now "
                "(experiments.train.Training runs it on several through Lightning)",
                cell.row.id,
                "train.devices",
            )


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
        GridError: a cell asks for more than one process (:func:`check_runnable`).
        TrackingError: the store is unreachable or unusable.
        CorpusError: a corpus source cannot be built.
    """
    check_runnable(grid, cells)
    quiet_lightning()
    pin_threads()
    scale = cells[0].scale
    uri = tracking_uri(results_dir)
    check_reachable(uri)
    for data_cfg in {c.config.data for c in cells}:
        build_corpus(data_cfg, cache_root, log=out)
    tracker = Tracker(uri, experiment_name(grid.name, scale), results_dir / "mlartifacts")
    return SweepContext(grid, tracker, results_dir, cache_root, stop or StopRequest(), out)


def run_cell(
    cell: Cell, ctx: SweepContext, prefix: str, clock: SweepClock, force: bool = False
) -> CellResult:
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
        A :class:`CellResult`: finished, resumed, skipped, diverged, failed or killed (a signal
        stopped it; its state is saved and the next sweep resumes it).

    Raises:
        KeyboardInterrupt, SystemExit: a second Ctrl-C; the run is marked killed first.
    """
    tracker, out = ctx.tracker, ctx.out
    done = tracker.done_run(cell.run_key)
    if done is not None and not force:
        return CellResult(cell, Outcome.SKIPPED, note=f"{done.data.tags['status']} earlier")
    unfinished = tracker.resumable_run(cell.run_key)
    if unfinished is not None and (owner := live_owner(unfinished)):
        return CellResult(cell, Outcome.SKIPPED, note=f"being trained by {owner}")
    resume_from, replayed = None, {}
    if unfinished is not None:
        checkpoints = checkpoint_dir(
            ctx.results_dir, tracker.experiment_name_of(unfinished), unfinished.info.run_id
        )
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

    def ended(status: str, note: str = "") -> CellResult:
        clock.cell_done(time.perf_counter() - started)
        return CellResult(cell, status, time.perf_counter() - started, note=note)

    try:
        final = train_cell(
            cell,
            tracker,
            run_id,
            ctx.grid.reference_config(cell.scale, cell.row).model.param_counts()[0],
            ProgressPrinter(prefix, clock, out),
            ctx.cache_root,
            checkpoints,
            extra_callbacks=[StopOnRequest(ctx.stop, checkpoints)],
            resume_from=resume_from,
            replayed=replayed,
        )
    except Interrupted as err:
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
    outcome = ended(Outcome.RESUMED if unfinished is not None else Outcome.FINISHED)
    outcome.avg_ppl = final[N.VAL_PPL_AVG]
    domains = ", ".join(f"{N.domain_of(k)} {v:.2f}" for k, v in final.items() if N.domain_of(k))
    probes = "probes failed (tag probe_error)"
    if N.F_ATTN in final:
        probes = f"F-Attn {final[N.F_ATTN]:.3f}, M-Act {final[N.M_ACT]:.1f}"
    if N.GATE_SCORE_MEAN in final:
        probes += f", gate score {final[N.GATE_SCORE_MEAN]:.3f}"
    out(f"{prefix} done in {outcome.seconds:.0f} s: Avg PPL {outcome.avg_ppl:.2f} ({domains}); {probes}")
    return outcome


def run_sweep(
    grid: Grid,
    cells: list[Cell],
    results_dir: Path,
    force: bool = False,
    cache_root: Path | None = None,
    out: Callable[[str], None] = print,
    stop: StopRequest | None = None,
) -> list[CellResult]:
    """Train every cell that has no result, in order, in this process; never raises for one
    cell's failure. With an active ``stop`` (see :mod:`sweep.run.interrupt`), Ctrl-C or SIGTERM
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
        One :class:`CellResult` per cell, in order; a cell whose config equals an earlier cell's
        (the same ``run_key``) is trained once, and both report what happened to it.

    Raises:
        TrackingError, CorpusError: before any run exists (see :func:`prepare_sweep`).
    """
    ctx = prepare_sweep(grid, cells, results_dir, cache_root, stop, out)
    ctx.stop.arm()
    first: dict[str, Cell] = {}  # a cell two rows share (the same run_key) is trained once
    for cell in cells:
        first.setdefault(cell.run_key, cell)
    unique = list(first.values())
    todo = [c for c in unique if force or ctx.tracker.done_run(c.run_key) is None]
    out(
        f"sweep {grid.name} at scale {cells[0].scale}: {len(cells)} cells, {len(todo)} to train, "
        f"{len(unique) - len(todo)} finished earlier; tracking {ctx.tracker.uri}"
    )
    outcomes: dict[int, CellResult] = {}
    clock = SweepClock(len(todo))
    for i, cell in enumerate(todo, start=1):
        if ctx.stop.signum is not None:
            outcomes[id(cell)] = CellResult(
                cell, Outcome.KILLED, note="not started: the sweep was interrupted"
            )
            continue
        prefix = f"[{i:>{len(str(len(todo)))}}/{len(todo)}] {cell.row.id} s{cell.seed}"
        outcomes[id(cell)] = run_cell(cell, ctx, prefix, clock, force)
    for cell in cells:
        twin = first[cell.run_key]
        if twin is not cell:  # another row of the same config: what happened to that cell
            done = outcomes.get(id(twin), CellResult(twin, Outcome.SKIPPED))
            outcomes[id(cell)] = CellResult(cell, done.status, note=f"the same config as row {twin.row.id}")
        elif id(cell) not in outcomes:
            outcomes[id(cell)] = CellResult(cell, Outcome.SKIPPED, note="finished earlier")
    return [outcomes[id(c)] for c in cells]


def summary_line(outcomes: list[CellResult]) -> str:
    """``finished 12, resumed 1, skipped 0, diverged 0, failed 0`` (``killed`` only if any)."""
    counts = {s: sum(o.status == s for o in outcomes) for s in Outcome.SUMMARY}
    return ", ".join(f"{k} {v}" for k, v in counts.items() if k != Outcome.KILLED or v)
