"""``make params``: total, active and added parameters of each row, counted from the configs."""

from __future__ import annotations

import pandas as pd

from sweep.grid import Grid
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
    """Each row's planned peak memory a GPU (``experiments.memory.memory_plan``, GiB) under its
    strategy, by part: weights, gradients, optimizer, FSDP's gathered weights, and activations at
    the micro-batch without and with per-block checkpointing; the total counts the row's own
    ``train.activation_checkpointing``, beside its ``train.gpu_memory_gib`` budget."""
    from experiments.memory import USABLE, memory_plan

    table = []
    for number, row, *_ in row_parameters(grid, scale, rows):
        cfg = grid.resolve(scale, row, 0)
        t, plan = cfg.train, memory_plan(cfg)
        budget = t.gpu_memory_gib
        table.append(
            {
                "#": number,
                "Method": row.label,
                "Strategy": f"{t.strategy} x{t.world_size}, {plan.precision}"
                + (f", sync per {t.grad_sync.replace('_', '-')}" if t.grad_accum > 1 else ""),
                "Micro-batch": f"{t.device_batch} x {t.seq_len}"
                + (f" (x{t.grad_accum})" if t.grad_accum > 1 else ""),
                "Weights": fmt(plan.weights, digits=2),
                "Grads": fmt(plan.gradients, digits=2),
                "Optimizer": fmt(plan.optimizer, digits=2),
                "Gathered": fmt(plan.gathered, digits=2),
                "Activations": fmt(plan.activations, digits=1),
                "Act. (ckpt)": fmt(plan.activations_checkpointed, digits=1),
                "Total": fmt(plan.total, digits=1) + (" (ckpt)" if plan.checkpointing else ""),
                "Budget": f"{USABLE * budget:.1f} of {budget:g}" if budget else "-",
                "Fits": ("yes" if plan.total <= USABLE * budget else "NO") if budget else "-",
            }
        )
    return pd.DataFrame(table)


def print_params(grid: Grid, scale: str, rows: list[str] | None = None) -> None:
    """``make params``: the parameter table, then the memory table (GiB a GPU)."""
    from experiments.memory import RUNTIME_GIB
    from sweep.report.display import markdown_table

    print(f"{grid.title} - parameters at scale '{scale}' (counted from the configs)")
    print(markdown_table(params_table(grid, scale, rows)))
    print(
        f"\nPeak memory a GPU at scale '{scale}', GiB (planned, not measured: docs/scales.md; "
        f"the total adds {RUNTIME_GIB:g} GiB of runtime)"
    )
    print(markdown_table(memory_table(grid, scale, rows)))
