"""What a sweep did, cell by cell: one outcome per cell, read back from the queue, and the
summary line that counts them (``finished 12, resumed 1, skipped 0, diverged 0, failed 0``)."""

from __future__ import annotations

from optuna.trial import FrozenTrial, TrialState

from experiments.names import Outcome
from sweep.grid import Cell
from sweep.run.queue import Queue
from sweep.run.runner import CellResult, SweepContext


def queue_outcomes(
    queue: Queue, cells: list[Cell], wanted: dict[str, int], ctx: SweepContext, own: set[str] | None = None
) -> list[CellResult]:
    """One outcome per cell: skipped (a result before this sweep), or the last outcome a worker
    recorded on one of its trials from ``wanted[run_key]`` on (trial numbers, not clocks: the
    workers may be on other machines); ``skipped`` never replaces an earlier outcome (a younger
    twin, taken after the older one's result, only finds that result). With ``own`` (this
    sweep's workers, ``host:pid``), a cell another sweep's worker took reads ``skipped``, its note
    saying who and what: the summary counts what this sweep did."""
    last: dict[str, FrozenTrial] = {}
    for t in queue.study.get_trials(deepcopy=False):  # in trial-number order
        key, recorded = t.user_attrs.get("run_key"), t.user_attrs.get("outcome")
        if key in wanted and recorded and recorded != Outcome.DUPLICATE and t.number >= wanted[key]:
            if recorded == Outcome.SKIPPED and key in last:  # a younger twin found the result
                continue
            last[key] = t
    queued = set(wanted)
    pending = {t.user_attrs.get("run_key") for t in queue.in_flight()}
    running = {
        t.user_attrs.get("run_key"): t.user_attrs.get("worker", "another worker")
        for t in queue.in_flight()
        if t.state == TrialState.RUNNING
    }
    outcomes = []
    for cell in cells:
        if cell.run_key not in queued:
            outcomes.append(CellResult(cell, Outcome.SKIPPED, note="finished earlier"))
        elif cell.run_key in last:
            t = last[cell.run_key]
            worker, outcome = t.user_attrs.get("worker", "?"), t.user_attrs["outcome"]
            if own is not None and worker not in own:
                note = f"{outcome} by another sweep's worker {worker}"
                outcomes.append(CellResult(cell, Outcome.SKIPPED, note=note))
            else:
                outcomes.append(CellResult(cell, outcome, note=t.user_attrs.get("note", "")))
        elif ctx.tracker.current_result(cell) is not None:
            outcomes.append(CellResult(cell, Outcome.SKIPPED, note="finished by another sweep"))
        elif ctx.stop.signum is not None:
            outcomes.append(CellResult(cell, Outcome.NOT_STARTED, note="the sweep was interrupted"))
        elif own is not None and cell.run_key in running and (worker := running[cell.run_key]) not in own:
            outcomes.append(CellResult(cell, Outcome.BUSY, note=f"being trained by {worker}"))
        elif cell.run_key in pending:  # this machine's workers died: another's, or a rerun, take it
            note = "still in the queue: another machine's worker or the same command again trains it"
            outcomes.append(CellResult(cell, Outcome.FAILED, note=note))
        else:
            note = "no worker finished it (see the workers' output)"
            outcomes.append(CellResult(cell, Outcome.FAILED, note=note))
    return outcomes


def summary_line(outcomes: list[CellResult]) -> str:
    """``finished 12, resumed 1, skipped 0, diverged 0, failed 0``, then ``restarted``, ``busy``,
    ``killed`` and ``not started`` where some cell had them (in the order of ``Outcome.SUMMARY``).
    Cells, not rows: two rows of one config (one ``run_key``) count once."""
    once = list({o.cell.run_key: o for o in reversed(outcomes)}.values())  # the first row's outcome
    counts = {s: sum(o.status == s for o in once) for s in Outcome.SUMMARY}
    return ", ".join(f"{k} {v}" for k, v in counts.items() if k not in Outcome.SUMMARY_IF_ANY or v)
