"""``make params``: total, active and added parameters of each row, counted from the configs."""

from __future__ import annotations

import pandas as pd

from sweep.grid import Grid
from sweep.report.display import fmt, fmt_params
from sweep.report.tables import paper_table, paper_value, row_parameters


def params_table(grid: Grid, scale: str, rows: list[str] | None = None) -> pd.DataFrame:
    """Total, active and added parameters of each row (default all), counted analytically
    (``ModelConfig.param_counts``), beside the paper's added parameters (Table 1's column)."""
    paper = paper_table(grid.paper_table)
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
