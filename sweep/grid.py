"""YAML grid -> validated cells (row x seed), each a :class:`RunConfig` with a stable ``run_key``.

A grid holds ``base`` (model / train / data), named ``scales`` that resize the base, and
``rows`` that override it. A row value ``x2`` or ``x1.5`` means "the scale's value times
that" (``x12/7`` a fraction, exact for integers), so one row list serves every scale
(``n_kv_heads: x2`` is Table 1's k = 8 at the paper's size). ``inherit: other.yaml`` (a path
relative to the grid) takes that grid's ``base`` and ``scales`` as this grid's starting point,
so Tables 1, 3 and 4 share one definition of the model and of each scale.
Precedence: dataclass defaults < base < scale < row.

The file's schema is :class:`GridSpec`, read by the same strict loader as the run configs
(``experiments.strict``). Everything is checked before any training; a problem raises
:class:`~sweep.gridfile.GridError`, whose message is one line naming the file, the row and the
key path.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from experiments.config import RunConfig, TrainConfig
from experiments.corpus import recipe_hash
from experiments.names import ProbeColumn
from experiments.numerics import NUMBERS_VERSION
from experiments.strict import ConfigError, from_dict, identity_dict, to_dict
from sweep.evalspec import EvalConfig, LongContextSpec
from sweep.gridcheck import check_references, check_stage
from sweep.gridfile import MAX_SEEDS, NAME, GridError, deep_merge, inherit, read_yaml

_ROW_ID = re.compile(r"^[a-z0-9_]+$")
_ROW_PATH = re.compile(r"^rows\[(\d+)\](?:\.(.*))?$")


@dataclass(frozen=True)
class Sections:
    """Overrides of the run config's sections (``base``, one scale, one row). Values may be
    ``xN`` (times the value below); the merged result is checked as a :class:`RunConfig`."""

    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {k: v for k, v in to_dict(self).items() if v}


#: Characters a label or title may not hold: Markdown reads ``<``, ``>`` as HTML, matplotlib
#: reads ``$`` as the start of math (an unpaired one fails the figure after training).
_MARKUP = "<>$"


def check_shown_text(key: str, text: str) -> None:
    """A label or title is shown as written in Markdown, LaTeX and figures.

    Raises:
        ConfigError: ``text`` holds a character of :data:`_MARKUP`.
    """
    bad = sorted({c for c in text if c in _MARKUP})
    if bad:
        raise ConfigError(
            key, f"must not hold {', '.join(map(repr, bad))} (Markdown reads <> as HTML, figures $ as math)"
        )


@dataclass(frozen=True)
class Row:
    """One row of a paper table: overrides of the base, and where the paper reports it."""

    id: str
    """Names the row in ``ROWS=``, in MLflow (tag ``row``) and in the table files: ``[a-z0-9_]``."""
    label: str = ""
    """The table's "Method" column (default: the id)."""
    paper_row: int | None = None
    """The paper table's row number, for the paper's own figures beside ours."""
    compare_to: str | None = None
    """The row this one's Δ PPL and added parameters are measured against (default: the grid's
    ``baseline_row``); Table 2 compares each 48-layer row with the 48-layer baseline, say."""
    paper_table: str | None = None
    """The paper table ``paper_row`` refers to, when not the grid's: a control row of Table 1
    whose paper figures are in Table 4, say."""
    parent: str | None = None
    """A later training stage: this row starts from the finished weights of row ``parent``'s cell
    of the same scale and seed (a new optimiser, its own steps and LR schedule), and its
    overrides apply on top of the parent row's, so ``seq_len: x4`` is four times the parent's
    context. Only ``model.rope_theta`` and ``model.max_seq_len`` may differ from the parent's
    model (the weights must fit). Table 5's continued long-context training (Section 4.4)."""
    model: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _ROW_ID.match(self.id):
            raise ConfigError("id", f"needs an 'id' of [a-z0-9_], got {self.id!r}")
        if not self.label:
            object.__setattr__(self, "label", self.id)
        check_shown_text("label", self.label)

    @property
    def overrides(self) -> dict[str, dict[str, Any]]:
        """The row's model / train / data overrides (the sections it sets)."""
        return {k: v for k, v in (("model", self.model), ("train", self.train), ("data", self.data)) if v}


@dataclass(frozen=True)
class GridSpec:
    """A grid file's top level, as written (``inherit`` already applied)."""

    name: str
    """Names the MLflow experiment (``<name>-<scale>``) and the table files."""
    base: Sections
    scales: dict[str, Sections | None]
    rows: tuple[Row, ...]
    title: str | None = None
    paper_table: str | None = None
    """The paper's numbers shipped as ``sweep/paper/<paper_table>.csv``."""
    baseline_row: str = "baseline"
    seeds: Any = 1
    """A count (seeds 0..N-1) or a list of distinct seeds >= 0."""
    columns: tuple[ProbeColumn, ...] = ("gate_score",)
    """Probe columns the Markdown / LaTeX table shows beside PPL (``experiments.names.PROBE_COLUMNS``)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Benchmarks run on every finished run (``sweep.eval``)."""
    longctx: LongContextSpec | None = None
    """Long-context scores by evaluation length, with and without YaRN, after training (Table 5);
    a grid with it gets Table 5's report (``sweep.report.longctx``)."""
    share_of: str | None = None
    """A row whose Δ Avg PPL the others' are divided by (the "share of G1's gain" column)."""
    curve_rows: tuple[str, ...] = ()
    """Rows whose ranking must hold over the last third of training (``sweep.report.curves``);
    default every row."""
    lr_ladder: tuple[float, ...] = ()
    """The max LRs of the grid's stability ladder (``make stability``), increasing; each at least
    every cell's ``train.min_lr``. Empty: the grid has none."""
    inherit: str | None = None

    def __post_init__(self) -> None:
        check_shown_text("title", self.title or "")
        if not NAME.match(self.name):
            raise ConfigError(
                "name", f"must be letters, digits, '_', '.', '-' (a file name), got {self.name!r}"
            )
        if not self.scales:
            raise ConfigError("scales", "defines no scale")
        for scale in self.scales:
            if not NAME.match(scale):
                raise ConfigError(
                    f"scales.{scale}", "a scale name must be letters, digits, '_', '.', '-' (a file name)"
                )
        if not self.rows:
            raise ConfigError("rows", "must be a non-empty list of rows")
        seeds = self.seeds
        if isinstance(seeds, int) and not isinstance(seeds, bool) and 0 < seeds <= MAX_SEEDS:
            object.__setattr__(self, "seeds", tuple(range(seeds)))
        elif (
            isinstance(seeds, list)
            and 0 < len(seeds) <= MAX_SEEDS
            and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds)
            and len(set(seeds)) == len(seeds)
        ):
            object.__setattr__(self, "seeds", tuple(seeds))
        else:
            shown = f"a list of {len(seeds)}" if isinstance(seeds, list) and len(seeds) > 10 else repr(seeds)
            raise ConfigError(
                "seeds",
                f"must be a count of 1 to {MAX_SEEDS} or a list of at most {MAX_SEEDS} distinct integers "
                f">= 0, got {shown}",
            )
        ladder = list(self.lr_ladder)
        if any(lr <= 0 for lr in ladder) or ladder != sorted(set(ladder)):
            raise ConfigError("lr_ladder", f"must be distinct positive LRs in increasing order, got {ladder}")


#: A grid file's top-level keys (:class:`GridSpec`'s fields), the required ones first: a file that
#: holds none of them is not a grid (``sweep.gridfile.read_yaml``).
GRID_KEYS = tuple(f.name for f in fields(GridSpec))


@dataclass(frozen=True)
class Cell:
    """One trainable unit: a row at a scale with one seed."""

    grid: str
    scale: str
    row: Row
    seed: int
    config: RunConfig
    run_key: str
    parent: Cell | None = None
    """The cell whose finished weights this one starts from (``Row.parent``), else None."""


@dataclass
class Grid:
    """A parsed grid file (:func:`load_grid`; its fields are :class:`GridSpec`'s, resolved).
    ``cells()`` expands and validates one scale of it."""

    file: Path
    name: str
    title: str
    base: dict[str, Any]
    scales: dict[str, dict[str, Any]]
    rows: list[Row]
    seeds: list[int]
    baseline_row: str
    paper_table: str | None
    columns: tuple[str, ...]
    """Probe columns the Markdown / LaTeX table shows (``GridSpec.columns``)."""
    eval: EvalConfig
    share_of: str | None = None
    longctx: LongContextSpec | None = None
    """The long-context evaluation (``GridSpec.longctx``), or None."""
    """The row of the "share of its gain" column (``GridSpec.share_of``), or None."""
    curve_rows: tuple[str, ...] = ()
    """Rows whose ranking the curves report checks (``GridSpec.curve_rows``); empty: all."""
    lr_ladder: tuple[float, ...] = ()
    """The stability ladder's max LRs (``GridSpec.lr_ladder``)."""

    def row_ids(self) -> list[str]:
        return [r.id for r in self.rows]

    def resolve(self, scale: str, row: Row | None, seed: int) -> RunConfig:
        """The row's RunConfig at ``scale`` for ``seed`` (``row=None``: base + scale alone).

        Raises:
            GridError: naming ``scales.<scale>.<key>`` when base + scale are invalid by
                themselves, else the row and the key path, with the scale.
        """
        merged = self.merged(scale, row)
        if row is None:
            try:
                return from_dict(RunConfig, {**merged, "seed": seed})
            except ConfigError as err:
                raise GridError(self.file, err.message, path=f"scales.{scale}.{err.path}") from None
        try:
            return from_dict(RunConfig, {**merged, "seed": seed})
        except ConfigError as err:
            raise GridError(self.file, f"{err.message} (at scale '{scale}')", row.id, err.path) from None

    def merged(self, scale: str, row: Row | None) -> dict[str, Any]:
        """The row's sections at ``scale`` as written (base, scale, then each stage's row), before
        the config's checks and defaults (``row=None``: base + scale alone)."""
        merged = deep_merge(self.base, self.scales[scale], "", row=None, file=self.file)
        for stage in self.lineage(row) if row is not None else ():  # a stage builds on its parents'
            merged = deep_merge(merged, stage.overrides, "", row=stage.id, file=self.file)
        return merged

    def log_every_notes(self, cells: list[Cell]) -> list[str]:
        """One line per scale and budget whose cells ask to log the training loss every more steps
        than they train: ``TrainConfig`` clamps ``log_every`` to ``max_steps`` (else no step would
        log it), and this says so."""
        clamped: dict[tuple[str, int, int], list[str]] = {}
        for cell in cells:
            asked = self.merged(cell.scale, cell.row).get("train", {}).get("log_every", TrainConfig.log_every)
            if asked != cell.config.train.log_every:
                ids = clamped.setdefault((cell.scale, asked, cell.config.train.max_steps), [])
                ids += [] if cell.row.id in ids else [cell.row.id]
        return [
            f"note: {self.file}: train.log_every {asked} is more than max_steps {steps} (scale '{scale}', "
            f"rows {', '.join(ids)}): the training loss is logged every {steps} steps instead"
            for (scale, asked, steps), ids in clamped.items()
        ]

    def row(self, row_id: str) -> Row:
        """The row named ``row_id`` (KeyError if none)."""
        return next(r for r in self.rows if r.id == row_id)

    def lineage(self, row: Row) -> list[Row]:
        """``row`` and its parent rows, the first stage first (a row without ``parent``: just it)."""
        chain = [row]
        while chain[0].parent is not None:
            chain.insert(0, self.row(chain[0].parent))
        return chain

    def cells(self, scale: str, seeds: list[int] | None = None, rows: list[str] | None = None) -> list[Cell]:
        """Every (row, seed) cell of ``scale``, validated, in the grid's row order. A chosen later
        stage brings its parent rows' cells along (it cannot train without them).

        Raises:
            GridError: unknown scale or row id, or any invalid cell.
        """
        if scale not in self.scales:
            raise GridError(
                self.file, f"unknown scale '{scale}'; defined: {', '.join(self.scales)}", path="scales"
            )
        self.resolve(scale, None, 0)  # a broken scale is the scale's fault, not the first row's
        chosen = self.rows
        if rows:
            unknown = [r for r in rows if r not in self.row_ids()]
            if unknown:
                raise GridError(
                    self.file, f"unknown row id(s) {', '.join(unknown)}; known: {', '.join(self.row_ids())}"
                )
            needed = {stage.id for rid in rows for stage in self.lineage(self.row(rid))}
            chosen = [r for r in self.rows if r.id in needed]
        out: list[Cell] = []
        by_row: dict[tuple[str, int], Cell] = {}
        for row in chosen:  # parents come first: load_grid checks each is an earlier row
            for seed in seeds if seeds is not None else self.seeds:
                cfg = self.resolve(scale, row, seed)
                parent = by_row[(row.parent, seed)] if row.parent is not None else None
                cell = Cell(self.name, scale, row, seed, cfg, run_key(cfg, parent), parent)
                by_row[(row.id, seed)] = cell
                out.append(cell)
        return out

    @staticmethod
    def same_config_rows(cells: list[Cell]) -> list[tuple[str, ...]]:
        """Groups of rows whose cells resolve to one config (one ``run_key``): trained once, that
        run shown in each of the rows."""
        rows: dict[str, list[str]] = {}
        for cell in cells:
            ids = rows.setdefault(cell.run_key, [])
            if cell.row.id not in ids:
                ids.append(cell.row.id)
        return sorted({tuple(ids) for ids in rows.values() if len(ids) > 1})

    @property
    def baseline(self) -> Row:
        """The row every other row's Δ and added parameters are measured against."""
        return next(r for r in self.rows if r.id == self.baseline_row)

    def baseline_config(self, scale: str) -> RunConfig:
        """The baseline row's config at ``scale`` (seed 0)."""
        return self.resolve(scale, self.baseline, 0)

    def reference(self, row: Row) -> Row:
        """The row ``row`` is compared with: its ``compare_to``, else the grid's baseline row."""
        rid = row.compare_to or self.baseline_row
        return next(r for r in self.rows if r.id == rid)

    def reference_config(self, scale: str, row: Row) -> RunConfig:
        """The config (seed 0) of ``row``'s reference at ``scale``: what ``params/added`` subtracts."""
        return self.resolve(scale, self.reference(row), 0)


def run_key(cfg: RunConfig, parent: Cell | None = None) -> str:
    """16 hex chars of sha256 over the canonical JSON of the resolved config (seed included, the
    placement fields ``TrainConfig.PLACEMENT`` and later options at their defaults left out:
    ``experiments.strict.identity_dict``) and the corpus recipe hash (which also
    covers source pins and the stdlib's Python version), the numbers version of the code
    (:data:`experiments.numerics.NUMBERS_VERSION`: a change that moves the numbers trains anew
    rather than reuse runs of the old ones); for a later stage, also its parent cell's run key
    (another parent, another run).

    Two grids that resolve a cell to the same config share its run: it is trained once."""
    config = identity_dict(cfg)
    for name in TrainConfig.PLACEMENT:
        del config["train"][name]
    payload: dict[str, Any] = {"config": config, "corpus": recipe_hash(cfg.data), "numbers": NUMBERS_VERSION}
    if parent is not None:  # only stages: every existing run key stays as it was
        payload["parent"] = parent.run_key
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def table_number(row: Row, position: int) -> int:
    """The "#" a table prints for ``row`` at 1-based ``position``: its ``paper_row``, unless that
    refers to another paper table (a control row) or is missing."""
    return row.paper_row if row.paper_row is not None and row.paper_table is None else position


def load_grid(file: str | Path) -> Grid:
    """Parse and check a grid file (schema, row references, every cell of every scale).

    Raises:
        GridError: with the file, row and key path of the first problem found.
    """
    file = Path(file)
    raw = read_yaml(file, GRID_KEYS)  # a mapping holding a grid's key
    if "inherit" in raw:
        raw = inherit(file, raw, GRID_KEYS)
    try:
        spec = from_dict(GridSpec, raw)
    except ConfigError as err:
        raise _grid_error(file, raw, err) from None
    check_references(file, spec)
    grid = Grid(
        file=file,
        name=spec.name,
        title=spec.title or spec.name,
        base=spec.base.as_dict(),
        scales={k: v.as_dict() if v else {} for k, v in spec.scales.items()},
        rows=list(spec.rows),
        seeds=list(spec.seeds),
        baseline_row=spec.baseline_row,
        paper_table=spec.paper_table,
        columns=spec.columns,
        eval=spec.eval,
        share_of=spec.share_of,
        longctx=spec.longctx,
        curve_rows=spec.curve_rows,
        lr_ladder=spec.lr_ladder,
    )
    for scale in grid.scales:
        for cell in grid.cells(scale):
            if cell.parent is not None:
                check_stage(file, cell)
            if grid.lr_ladder and grid.lr_ladder[0] < cell.config.train.min_lr:
                low, min_lr = grid.lr_ladder[0], cell.config.train.min_lr
                raise GridError(
                    file,
                    f"rung {low:g} is below train.min_lr {min_lr:g} (at scale '{scale}')",
                    cell.row.id,
                    "lr_ladder",
                )
    return grid


def _grid_error(file: Path, raw: dict, err: ConfigError) -> GridError:
    """The schema's error, naming the row by its id where the path is inside ``rows[i]``."""
    match = _ROW_PATH.match(err.path)
    if match is None or match.group(2) in (None, "id"):
        return GridError(file, err.message, path=err.path)
    entry = raw["rows"][int(match.group(1))]
    rid = entry.get("id") if isinstance(entry, dict) else None
    return GridError(
        file, err.message, rid if isinstance(rid, str) else f"rows[{match.group(1)}]", match.group(2)
    )
