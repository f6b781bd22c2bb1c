"""Which finished runs ``make export RUNS=...`` writes, and where; every check before any write.

A name in ``RUNS`` is a row id of the grid (its current finished result at ``scale``, one per seed,
as ``make compare`` reads a row) or a run id of the tracking store (any experiment). Each becomes an
:class:`ExportJob` whose folder is ``<dest>/<experiment>/<row>_s<seed>``.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from experiments.checkpointing import FINAL_CHECKPOINT, checkpoint_problem
from experiments.config import ConfigError, RunConfig, from_dict
from experiments.names import Kind, Status
from sweep.grid import Grid, Row
from sweep.store import Tracker


class ExportError(ValueError):
    """A name that is no exportable run (unknown, unfinished, diverged, its weights gone or
    damaged), or a destination that exists without ``FORCE=1``; one line."""


@dataclass(frozen=True)
class ExportJob:
    """One run to export."""

    run: Any
    """The MLflow run (``finished``)."""
    config: RunConfig
    """The run's resolved config (its ``config.yaml`` artifact)."""
    paper_row: str
    """The paper's row the run stands for (``row 5 of table1_moe``), or ``—``."""
    experiment: str
    """The run's experiment (``<grid>-<scale>``)."""
    checkpoint: Path
    """Its ``final.ckpt``, content-checked."""
    dest: Path
    """The folder to write."""

    @property
    def name(self) -> str:
        """``<row>_s<seed>``: the folder's name."""
        return self.dest.name


def export_jobs(
    names: list[str], grid: Grid, scale: str, tracker: Tracker, dest_root: Path, force: bool
) -> list[ExportJob]:
    """The runs ``names`` stand for, each checked and with its destination.

    Raises:
        ExportError: a name that is neither a row of ``grid`` nor a run id, a row without a
            finished run at ``scale``, a run that is not finished (running, failed, killed,
            diverged: no final weights), a missing or damaged ``final.ckpt``, or a destination that
            exists while ``force`` is False; one line naming it.
    """
    if not names:
        raise ExportError("RUNS: give one or more row ids or run ids, a,b")
    jobs: list[ExportJob] = []
    for name in dict.fromkeys(names):
        row = next((r for r in grid.rows if r.id == name), None)
        runs = _row_runs(grid, scale, row, tracker) if row is not None else [(_run(name, tracker), None)]
        for run, config in runs:
            jobs.append(_job(run, config, _paper_row(grid, run, row), tracker, dest_root, force))
    seen: dict[Path, str] = {}
    for job in jobs:
        if job.dest in seen and seen[job.dest] != job.run.info.run_id:
            raise ExportError(
                f"RUNS: runs {seen[job.dest]} and {job.run.info.run_id} both export to {job.dest}"
            )
        seen[job.dest] = job.run.info.run_id
    return list({job.run.info.run_id: job for job in jobs}.values())


def check_destinations(jobs: list[ExportJob]) -> None:
    """Each job's folder can be written: the nearest existing folder above it is a folder this
    process may create in (tried with a temporary folder, removed at once), and the folder itself,
    if it exists, is a folder (``FORCE=1`` replaces folders, not files).

    Raises:
        ExportError: one line naming the path (``DEST: <path> is not a folder`` or ``... is not
            writable``).
    """
    for job in jobs:
        if job.dest.exists() and not job.dest.is_dir():
            raise ExportError(f"DEST: {job.dest} is not a folder (FORCE=1 replaces exported folders only)")
        above = next(p for p in (job.dest.parent, *job.dest.parent.parents) if p.exists() or p.is_symlink())
        if not above.is_dir():
            raise ExportError(f"DEST: {above} is not a folder")
        try:  # what the kernel says, not os.access: root on a read-only mount is refused too
            tempfile.TemporaryDirectory(dir=above, prefix=".export-check-").cleanup()
        except OSError as err:
            raise ExportError(f"DEST: {above} is not writable ({err.strerror})") from None


def _row_runs(grid: Grid, scale: str, row: Row, tracker: Tracker) -> list[tuple[Any, RunConfig]]:
    """The row's current results at every seed the store holds a result of; finished ones only."""
    done = tracker.cell_runs(Status.DONE)
    seeds = sorted({int(r.data.tags["seed"]) for r in done if r.data.tags.get("seed", "").isdigit()})
    keys = {r.data.tags.get("run_key") for r in done}
    found, diverged = [], []
    for cell in grid.cells(scale, seeds=seeds, rows=[row.id]) if seeds else []:
        if cell.row.id != row.id or cell.run_key not in keys:
            continue
        run = tracker.current_result(cell)
        if run is None:
            continue
        if run.data.tags.get("status") == Status.FINISHED:
            found.append((run, cell.config))
        else:
            diverged.append(f"s{cell.seed}")
    if not found:
        why = f" (diverged: {', '.join(diverged)}; no final weights)" if diverged else ""
        raise ExportError(f"RUNS: row '{row.id}' of {grid.file} has no finished run at scale {scale}{why}")
    return found


def _run(name: str, tracker: Tracker) -> Any:
    try:
        return tracker.client.get_run(name)
    except Exception:  # MLflow raises its own types for an unknown id
        raise ExportError(
            f"RUNS: '{name}' is neither a row of the grid nor a run id of the tracking store"
        ) from None


def _paper_row(grid: Grid, run: Any, row: Row | None) -> str:
    """``row N of <paper table>`` for a row of ``grid`` (a run id's too, when it is this grid's)."""
    tags = run.data.tags
    if row is None and tags.get("grid") == grid.name:
        row = next((r for r in grid.rows if r.id == tags.get("row")), None)
    if row is None or row.paper_row is None:
        return "—"
    table = row.paper_table or grid.paper_table
    return f"row {row.paper_row}" + (f" of {table}" if table else "")


def _job(
    run: Any, config: RunConfig | None, paper_row: str, tracker: Tracker, dest_root: Path, force: bool
) -> ExportJob:
    run_id, status = run.info.run_id, run.data.tags.get("status")
    if run.data.tags.get("kind") != Kind.CELL:
        raise ExportError(f"RUNS: run {run_id} is not a trained cell (kind {run.data.tags.get('kind')!r})")
    if status != Status.FINISHED:
        extra = ": a diverged run has no final weights" if status == Status.DIVERGED else ""
        raise ExportError(f"RUNS: run {run_id} ({run.data.tags.get('row')}) is {status}, not finished{extra}")
    checkpoint = Path(run.data.tags.get("checkpoint", ""))
    if checkpoint.name != FINAL_CHECKPOINT or not checkpoint.is_file():
        raise ExportError(f"RUNS: run {run_id}: no final checkpoint at {checkpoint}")
    if problem := checkpoint_problem(checkpoint):
        raise ExportError(f"RUNS: run {run_id}: checkpoint {checkpoint} is {problem}: retrain its cell")
    config = config or _stored_config(run, tracker)
    experiment = tracker.experiment_name_of(run)
    dest = dest_root / experiment / f"{run.data.tags.get('row', 'run')}_s{config.seed}"
    if dest.exists() and not force:
        raise ExportError(f"{dest} exists: FORCE=1 replaces it")
    return ExportJob(run, config, paper_row, experiment, checkpoint, dest)


def _stored_config(run: Any, tracker: Tracker) -> RunConfig:
    """The ``config.yaml`` artifact every cell run stores (``Tracker.start_cell``).

    Raises:
        ExportError: missing or not a config of this code.
    """
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = tracker.client.download_artifacts(run.info.run_id, "config.yaml", tmp)
            return from_dict(RunConfig, yaml.safe_load(Path(path).read_text()))
        except ConfigError as err:
            raise ExportError(f"RUNS: run {run.info.run_id}: config.yaml: {err}") from None
        except Exception as err:  # MLflow's own error types for a missing artifact
            raise ExportError(f"RUNS: run {run.info.run_id} has no readable config.yaml ({err})") from None
