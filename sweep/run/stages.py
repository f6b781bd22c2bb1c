"""Later training stages (``Row.parent``): where a stage's cell starts, and the tags that link
its run to its parent's (Table 5's continued long-context training)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from experiments.checkpointing import FINAL_CHECKPOINT, checkpoint_problem
from experiments.names import Status
from sweep.grid import Cell
from sweep.run.cell import checkpoint_dir
from sweep.store import Tracker


@dataclass
class Stage:
    """Where a later stage (``Row.parent``) starts: its parent's finished weights and run."""

    weights: Path
    tags: dict[str, str]  # parent_run, mlflow.parentRunId (the UI nests the stage under it), stage


def parent_stage(cell: Cell, tracker: Tracker, results_dir: Path) -> Stage | str:
    """The parent's finished weights and the tags that link the stage's run to the parent's;
    or, when the parent has none to give, a note saying why (the cell cannot train yet)."""
    parent = cell.parent
    done = tracker.current_result(parent)
    name = f"row {parent.row.id} s{parent.seed}"
    if done is None:
        return f"its parent {name} has no finished run"
    status = done.data.tags.get("status")
    if status != Status.FINISHED:
        return f"its parent {name} {status} (run {done.info.run_id})"
    run_id = done.info.run_id
    weights = checkpoint_dir(results_dir, tracker.experiment_name_of(done), run_id) / FINAL_CHECKPOINT
    retrain = f"FORCE=1 ROWS={parent.row.id} retrains it"
    if not weights.is_file():
        return f"its parent {name}'s weights {weights} are gone ({retrain})"
    if problem := checkpoint_problem(weights):
        return f"its parent {name}'s weights {weights} are {problem} ({retrain})"
    depth = 1
    while (parent := parent.parent) is not None:
        depth += 1
    tags = {"parent_run": run_id, "mlflow.parentRunId": run_id, "stage": str(depth + 1)}
    return Stage(weights, tags)
