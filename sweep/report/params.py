"""``make params``: total, active and added parameters of each row, counted from the configs."""

from __future__ import annotations

import sys

import pandas as pd

from sweep.grid import Grid
from sweep.gridfile import GridError
from sweep.report.display import fmt, fmt_params
from sweep.report.tables import paper_table, paper_value, row_parameters


def params_table(grid: Grid, scale: str, rows: list[str] | None = None) -> pd.DataFrame:
    """Total, active and added parameters of each row (default all), counted analytically
    (``ModelConfig.param_counts``), beside the paper's added parameters (Table 1's column)."""
    try:
        paper = paper_table(grid.paper_table)
    except KeyError:  # a paper table by another index (Table 5's RULER scores): no added column
        paper = None
    return pd.DataFrame(
        [
            {
                "#": number,
                "Method": row.label,
                "Total (M)": fmt(total / 1e6, digits=2),
                "Active (M)": fmt(active / 1e6, digits=2),
                "Added (M)": fmt_params(added / 1e6),
                "Paper Added (M)": fmt_params(paper_value(paper, row, "added_params_m")),
            }
            for number, row, total, active, added in row_parameters(grid, scale, rows)
        ]
    )


def memory_table(grid: Grid, scale: str, rows: list[str] | None = None) -> pd.DataFrame:
    """Each row's peak memory a GPU (GiB) under its strategy: planned by part
    (``experiments.memory.memory_plan``: weights, gradients, optimizer, FSDP's gathered weights,
    and activations at the micro-batch without and with per-block checkpointing; the total counts
    the row's own ``train.activation_checkpointing``), and for a sharded row with a
    ``train.gpu_memory_gib`` budget measured (``experiments.memory.measured_memory``, torch's
    FSDPMemTracker under FakeTensorMode: minutes a row, a line on stderr each), which then decides
    whether it fits."""
    from experiments.memory import USABLE, measured_memory, memory_plan

    table = []
    numbered = list(row_parameters(grid, scale, rows))
    for i, (number, row, *_) in enumerate(numbered, 1):
        cfg = grid.resolve(scale, row, 0)
        t, plan = cfg.train, memory_plan(cfg)
        budget, measured = t.gpu_memory_gib, None
        if budget and t.strategy == "fsdp":
            print(f"measuring {row.id} ({i} of {len(numbered)})", file=sys.stderr, flush=True)
            measured = measured_memory(cfg)
        peak = measured.total if measured else plan.total
        table.append(
            {
                "#": number,
                "Method": row.label,
                "Strategy": f"{t.strategy} x{t.world_size}, {plan.precision}"
                + (f", sync per {t.grad_sync.replace('_', '-')}" if t.grad_accum > 1 else ""),
                "Micro-batch": f"{t.device_batch} x {t.seq_len}"
                + (f" (x{t.grad_accum})" if t.grad_accum > 1 else "")
                + (f", loss {t.loss_chunk}" if t.loss_chunk else ""),
                "Weights": fmt(plan.weights, digits=2),
                "Grads": fmt(plan.gradients, digits=2),
                "Optimizer": fmt(plan.optimizer, digits=2),
                "Gathered": fmt(plan.gathered, digits=2),
                "Activations": fmt(plan.activations, digits=1),
                "Act. (ckpt)": fmt(plan.activations_checkpointed, digits=1),
                "Planned": fmt(plan.total, digits=1) + (" (ckpt)" if plan.checkpointing else ""),
                "Measured": fmt(measured.peak, digits=1) if measured else "-",
                "Budget": f"{USABLE * budget:.1f} of {budget:g}" if budget else "-",
                "Fits": ("yes" if peak <= USABLE * budget else "NO") if budget else "-",
            }
        )
    return pd.DataFrame(table)


def print_params(grid: Grid, scale: str, rows: list[str] | None = None) -> None:
    """``make params``: the parameter table, then the memory table (GiB a GPU).

    Raises:
        GridError: a row's measured peak (or its plan where none is measured) exceeds
            :data:`~experiments.memory.USABLE` of its ``train.gpu_memory_gib`` (after the tables).
    """
    from experiments.memory import RUNTIME_GIB, USABLE
    from sweep.report.display import markdown_table

    print(f"{grid.title} - parameters at scale '{scale}' (counted from the configs)")
    print(markdown_table(params_table(grid, scale, rows)))
    memory = memory_table(grid, scale, rows)
    print(
        f"\nPeak memory a GPU at scale '{scale}', GiB: planned on the meta device (with {RUNTIME_GIB:g} "
        "GiB of runtime), and for the sharded rows with a budget measured (torch's FSDPMemTracker under "
        f"FakeTensorMode, docs/scales.md), which decides the fit with the same {RUNTIME_GIB:g} GiB added"
    )
    print(markdown_table(memory))
    for (_, line), (_, row, *_) in zip(memory.iterrows(), row_parameters(grid, scale, rows)):
        if line["Fits"] != "NO":
            continue
        measured = line["Measured"] != "-"
        peak = (
            f"measured {line['Measured']} + {RUNTIME_GIB:g} of runtime"
            if measured
            else f"planned {line['Planned'].split()[0]}"
        )
        budget = line["Budget"].split()[-1]
        message = f"{peak} GiB a GPU at scale '{scale}', over {USABLE:.0%} of {budget} GiB (make params)"
        raise GridError(grid.file, message, row.id, "train.gpu_memory_gib")
