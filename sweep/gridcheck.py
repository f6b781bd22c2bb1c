"""A grid's cross-references, checked once its schema has loaded: row ids, the rows and scales
other keys name, paper tables and rows, and later stages (``sweep.grid``)."""

from __future__ import annotations

import csv
from importlib import resources
from pathlib import Path
from typing import Any

from experiments.strict import to_dict
from sweep.gridfile import GridError


def check_references(file: Path, spec: Any) -> None:
    """Every id, row, scale and paper table that ``spec`` (a ``sweep.grid.GridSpec``) names
    exists, and a stage's parent is an earlier row.

    Raises:
        GridError: naming the file, the row and the key of the first that does not.
    """
    ids = [r.id for r in spec.rows]
    for i, rid in enumerate(ids):
        if rid in ids[:i]:
            raise GridError(file, "duplicate row id", rid, "id")
    known = sorted(p.name.removesuffix(".csv") for p in paper_csv("").parent.iterdir())
    if spec.paper_table is not None and spec.paper_table not in known:
        raise GridError(
            file, f"unknown paper table {spec.paper_table!r}; known: {', '.join(known)}", path="paper_table"
        )
    for row in spec.rows:
        if row.paper_table is not None and row.paper_table not in known:
            raise GridError(
                file,
                f"unknown paper table {row.paper_table!r}; known: {', '.join(known)}",
                row.id,
                "paper_table",
            )
    _check_paper_layout(file, spec)
    if spec.share_of is not None and spec.share_of not in ids:
        raise GridError(file, f"names no row of the grid: '{spec.share_of}'", path="share_of")
    for rid in spec.longctx.rows if spec.longctx else ():
        if rid not in ids:
            raise GridError(file, f"names no row of the grid: '{rid}'", path="longctx.rows")
    for rid in spec.curve_rows:
        if rid not in ids:
            raise GridError(file, f"names no row of the grid: '{rid}'", path="curve_rows")
    for scale in spec.eval.scales or ():
        if scale not in spec.scales:
            raise GridError(file, f"names no scale of the grid: '{scale}'", path="eval.scales")
    for scale in spec.eval.at:
        if scale not in spec.scales:
            raise GridError(file, f"names no scale of the grid: '{scale}'", path="eval.at")
    if spec.baseline_row not in ids:
        raise GridError(file, f"names no row of the grid: '{spec.baseline_row}'", path="baseline_row")
    for i, row in enumerate(spec.rows):
        if row.parent is not None and row.parent not in ids[:i]:
            why = "is this row" if row.parent == row.id else "is no earlier row of the grid"
            raise GridError(file, f"'{row.parent}' {why} (a stage follows its parent)", row.id, "parent")
    for row in spec.rows:
        if row.compare_to is not None and row.compare_to not in ids:
            raise GridError(file, f"names no row of the grid: '{row.compare_to}'", row.id, "compare_to")
        table = row.paper_table or spec.paper_table
        known_rows = paper_rows(table) if row.paper_row is not None and table is not None else None
        if known_rows is not None and row.paper_row not in known_rows:
            raise GridError(
                file, f"{row.paper_row} is not a row of sweep/paper/{table}.csv", row.id, "paper_row"
            )


def _check_paper_layout(file: Path, spec: Any) -> None:
    """A paper table fits the report the grid writes: Table 5's by-length layout (a grid with
    ``longctx:``) reads the paper by ``method``, Tables 1-4's by ``row``."""
    column, layout = (
        ("method", "a grid with longctx: (Table 5's layout)")
        if spec.longctx
        else ("row", "a grid without longctx: (the layout of Tables 1-4)")
    )
    named = [(None, spec.paper_table)] + [(r.id, r.paper_table) for r in spec.rows]
    for row_id, name in named:
        if name is not None and column not in paper_columns(name):
            raise GridError(
                file,
                f"sweep/paper/{name}.csv has no '{column}' column, which {layout} reads it by",
                row_id,
                "paper_table",
            )


def paper_columns(name: str) -> list[str]:
    """The column names of the paper table ``sweep/paper/<name>.csv``."""
    with paper_csv(name).open() as f:
        return next(csv.reader(f), [])


def paper_csv(name: str) -> Path:
    """``sweep/paper/<name>.csv``: the paper's own numbers, shipped with the package."""
    return Path(str(resources.files("sweep").joinpath("paper", f"{name}.csv")))


def paper_rows(name: str) -> set[int] | None:
    """The row numbers of the paper table ``sweep/paper/<name>.csv``; None if it has no ``row``
    column."""
    with paper_csv(name).open() as f:
        reader = csv.DictReader(f)
        return {int(r["row"]) for r in reader} if "row" in (reader.fieldnames or ()) else None


#: What a later stage may change in its parent's model: the weights stay the same shapes.
STAGE_MODEL_KEYS = ("rope_theta", "max_seq_len")


def check_stage(file: Path, cell: Any) -> None:
    """A later stage's model (``cell``: a ``sweep.grid.Cell`` with a parent) must load its parent's
    weights: only :data:`STAGE_MODEL_KEYS` may differ.

    Raises:
        GridError: naming the row and the first other ``model.<key>`` that differs.
    """
    mine, theirs = to_dict(cell.config.model), to_dict(cell.parent.config.model)
    for key in mine:
        if key not in STAGE_MODEL_KEYS and mine[key] != theirs[key]:
            raise GridError(
                file,
                f"a stage may change only {' and '.join(STAGE_MODEL_KEYS)} of its parent's model "
                f"(the weights carry over): {theirs[key]!r} -> {mine[key]!r} (at scale '{cell.scale}')",
                cell.row.id,
                f"model.{key}",
            )
