"""What a sweep did, cell by cell: one outcome per cell, read back from the queue, and the
summary line that counts them (``finished 12, resumed 1, skipped 0, diverged 0, failed 0``)."""

from __future__ import annotations

from optuna.trial import FrozenTrial

from experiments.names import Outcome
from sweep.grid import Cell
from sweep.run.queue import Queue, held_elsewhere, sweep_of
from sweep.run.runner import CellResult, SweepContext


def queue_outcomes(
    queue: Queue, cells: list[Cell], wanted: dict[str, int], ctx: SweepContext, sweep: str | None = None
) -> list[CellResult]:
    """One outcome per cell: skipped (a result before this sweep), or the last outcome a worker
    recorded on one of its trials from ``wanted[run_key]`` on (trial numbers, not clocks: the
    workers may be on other machines); ``skipped`` never replaces an earlier outcome (a younger
    twin, taken after the older one's result, only finds that result). With ``sweep`` (this
    sweep's name, :func:`~sweep.run.queue.sweep_of`), the summary counts what this sweep did: a
    cell another sweep's worker took reads ``skipped``, its note saying who and what, and one
    that another sweep's live worker of this machine holds reads ``busy`` (also after a Ctrl-C;
    :func:`~sweep.run.queue.held_elsewhere`)."""
    last: dict[str, FrozenTrial] = {}
    for t in queue.study.get_trials(deepcopy=False):  # in trial-number order
        key, recorded = t.user_attrs.get("run_key"), t.user_attrs.get("outcome")
        if key in wanted and recorded and recorded != Outcome.DUPLICATE and t.number >= wanted[key]:
            if recorded == Outcome.SKIPPED and key in last:  # a younger twin found the result
                continue
            last[key] = t
    queued = set(wanted)
    pending = {t.user_attrs.get("run_key") for t in queue.in_flight()}
    parents = {c.run_key: c.parent.run_key for c in cells if c.parent is not None}
    held = held_elsewhere(queue, queued, parents, sweep) if sweep is not None else {}
    outcomes = []
    for cell in cells:
        if cell.run_key not in queued:
            outcomes.append(CellResult(cell, Outcome.SKIPPED, note="finished earlier"))
        elif cell.run_key in last:
            t = last[cell.run_key]
            worker, outcome = t.user_attrs.get("worker", "?"), t.user_attrs["outcome"]
            if sweep is not None and sweep_of(t) not in (None, sweep):
                note = f"{outcome} by another sweep's worker {worker}"
                outcomes.append(CellResult(cell, Outcome.SKIPPED, note=note))
            else:
                outcomes.append(CellResult(cell, outcome, note=t.user_attrs.get("note", "")))
        elif ctx.tracker.current_result(cell) is not None:
            outcomes.append(CellResult(cell, Outcome.SKIPPED, note="finished by another sweep"))
        elif cell.run_key in held:
            outcomes.append(CellResult(cell, Outcome.BUSY, note=busy_note(cell, held[cell.run_key])))
        elif ctx.stop.signum is not None:
            outcomes.append(CellResult(cell, Outcome.NOT_STARTED, note="the sweep was interrupted"))
        elif cell.run_key in pending:  # this machine's workers died: another's, or a rerun, take it
            note = "still in the queue: another machine's worker or the same command again trains it"
            outcomes.append(CellResult(cell, Outcome.FAILED, note=note))
        else:
            note = "no worker finished it (see the workers' output)"
            outcomes.append(CellResult(cell, Outcome.FAILED, note=note))
    return outcomes


def busy_note(cell: Cell, holder: FrozenTrial) -> str:
    """Who holds a ``busy`` cell: another sweep's worker, training it or its parent stage."""
    worker = holder.user_attrs.get("worker", "?")
    if holder.user_attrs.get("run_key") == cell.run_key:
        return f"another sweep's worker {worker} trains it (alive, or stopped: a stopped process counts)"
    parent = f"{holder.user_attrs.get('row')} s{holder.user_attrs.get('seed')}"
    return f"waits for its parent stage {parent}, which another sweep's worker {worker} trains"


def summary_line(outcomes: list[CellResult]) -> str:
    """``finished 12, resumed 1, skipped 0, diverged 0, failed 0``, then ``restarted``, ``busy``,
    ``killed`` and ``not started`` where some cell had them (in the order of ``Outcome.SUMMARY``).
    Cells, not rows: two rows of one config (one ``run_key``) count once."""
    once = list({o.cell.run_key: o for o in reversed(outcomes)}.values())  # the first row's outcome
    counts = {s: sum(o.status == s for o in once) for s in Outcome.SUMMARY}
    return ", ".join(f"{k} {v}" for k, v in counts.items() if k not in Outcome.SUMMARY_IF_ANY or v)
