"""How far apart two rows' benchmark scores are, against the noise of the documents scored:
``python -m sweep.eval.paired --grid grids/table1.yaml --rows baseline,sdpa_elementwise``.

Scores both rows' finished runs (seed 0) on the same documents and prints, per task, each run's
mean bits per byte, their difference and its standard error paired by document (the sample std of
the per-document differences over sqrt(n)): the difference a table's ``Δ bench bpb`` can resolve
at that many documents is about twice it. Nothing is logged; run it alone (it is timed), from
the folder the sweep ran in (the runs name their checkpoints relative to it).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

from experiments.names import BPB_TASKS, Status
from experiments.strict import ConfigError
from sweep.eval.suite import BenchError


def paired_se(a: list[float], b: list[float]) -> tuple[float, float]:
    """Mean of ``b - a`` over documents and its standard error (sample std / sqrt(n)).

    Raises:
        ValueError: the lists differ in length or hold fewer than two documents.
    """
    if len(a) != len(b) or len(a) < 2:
        raise ValueError(f"paired documents: {len(a)} and {len(b)}; need two or more of each, as many")
    diff = [y - x for x, y in zip(a, b, strict=True)]
    mean = sum(diff) / len(diff)
    var = sum((d - mean) ** 2 for d in diff) / (len(diff) - 1)
    return mean, math.sqrt(var / len(diff))


def main(argv: list[str] | None = None) -> int:
    """Print the paired comparison; exit 2 with one line on bad input or missing runs, 1 with one
    line when a checkpoint cannot be read."""
    from experiments.checkpointing import CheckpointDamaged
    from sweep.eval.scores import evaluate_checkpoint, prepare_lm_eval
    from sweep.grid import GridError, load_grid
    from sweep.store import Tracker, experiment_name
    from sweep.store_urls import tracking_uri

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default="grids/table1.yaml")
    p.add_argument("--scale", default="tiny")
    p.add_argument("--rows", required=True, help="two row ids: reference,other")
    p.add_argument("--tasks", default=None, help="comma-separated (default: the grid's wheel tasks)")
    p.add_argument("--limit", type=int, default=None, help="documents a task (default: the scale's)")
    p.add_argument("--results", default="results")
    args = p.parse_args(argv)
    try:
        grid = load_grid(args.grid)
        rows = args.rows.split(",")
        if len(rows) != 2:
            raise GridError(Path(args.grid), f"--rows needs two row ids, got {args.rows!r}")
        spec = grid.eval.for_scale(args.scale)
        tasks = args.tasks.split(",") if args.tasks else [t for t in spec.tasks if t in BPB_TASKS]
        unknown = [t for t in tasks if t not in BPB_TASKS]
        if unknown:
            raise GridError(
                Path(args.grid), f"--tasks: {', '.join(unknown)} log no bpb; use {', '.join(BPB_TASKS)}"
            )
        if args.limit is not None:
            if args.limit < 2:
                raise GridError(
                    Path(args.grid), f"--limit: a paired error needs 2 documents or more, got {args.limit}"
                )
            spec = dataclasses.replace(spec, limit=args.limit)
        prepare_lm_eval(spec)  # offline, lm-eval's notices quiet
        results = Path(args.results)
        tracker = Tracker(
            tracking_uri(results), experiment_name(grid.name, args.scale), results / "mlartifacts"
        )
        per_row = {}
        for cell in grid.cells(args.scale, seeds=[0], rows=rows):
            run = tracker.current_result(cell)
            if run is None or run.data.tags.get("status") != Status.FINISHED or cell.row.id not in rows:
                continue  # a diverged run has no final weights to score
            started, samples = time.monotonic(), {}
            checkpoint = Path(run.data.tags.get("checkpoint", ""))
            evaluate_checkpoint(cell.config, checkpoint, spec, None, tasks, samples=samples)
            per_row[cell.row.id] = samples
            took = time.monotonic() - started
            print(f"{cell.row.id}: {len(tasks)} tasks, {spec.limit or 'all'} documents each, {took:.1f} s")
        missing = [r for r in rows if r not in per_row]
        if missing:
            raise GridError(
                Path(args.grid), f"no finished run of {', '.join(missing)} at {args.scale}; make sweep first"
            )
    except (GridError, BenchError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except ConfigError as err:  # --limit below 1
        print(f"error: --limit: {err.message}", file=sys.stderr)
        return 2
    except (OSError, CheckpointDamaged, ValueError) as err:  # a checkpoint gone or damaged
        print(f"error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    ref, other = rows
    print(f"{'task':18s} {'n':>6s} {ref + ' bpb':>20s} {other + ' bpb':>20s} {'diff':>8s} {'paired SE':>10s}")
    for task in tasks:
        a = [float(r["bpb"]) for r in per_row[ref][task]]
        b = [float(r["bpb"]) for r in per_row[other][task]]
        diff, se = paired_se(a, b)
        print(
            f"{task:18s} {len(a):6d} {sum(a) / len(a):20.4f} {sum(b) / len(b):20.4f} {diff:+8.4f} {se:10.4f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
