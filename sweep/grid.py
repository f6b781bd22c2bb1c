"""YAML grid -> validated cells (row x seed), each a :class:`RunConfig` with a stable ``run_key``.

A grid holds ``base`` (model / train / data), named ``scales`` that resize the base, and
``rows`` that override it. A row value ``x2`` or ``x1.5`` means "the scale's value times
that" (``x12/7`` a fraction, exact for integers), so one row list serves every scale
(``n_kv_heads: x2`` is Table 1's k = 8 at the paper's size). ``inherit: other.yaml`` (a path
relative to the grid) takes that grid's ``base`` and ``scales`` as this grid's starting point,
so Tables 1, 3 and 4 share one definition of the model and of each scale.
Precedence: dataclass defaults < base < scale < row.

Everything is checked before any training; a problem raises :class:`GridError`, whose message
is one line naming the file, the row and the key path.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from dataclasses import dataclass, field
from fractions import Fraction
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from experiments import SUPPORTED_FEATURES
from experiments.config import ConfigError, RunConfig, from_dict, to_dict
from experiments.corpus import recipe_hash

GRID_KEYS = {
    "name", "title", "paper_table", "baseline_row", "seeds", "base", "scales", "rows", "inherit", "columns",
    "eval",
}  # fmt: skip
EVAL_KEYS = {"tasks", "num_fewshot", "limit", "batch_size", "max_gen_toks"}
#: Probe columns a table may show (``columns:`` in a grid); the CSV always has all of them.
TABLE_COLUMNS = ("gate_score", "m_act", "f_attn", "loss_spikes")
ROW_KEYS = {"id", "label", "paper_row", "requires", "compare_to", "model", "train", "data"}
SECTION_KEYS = {"model", "train", "data"}
KNOWN_FEATURES = {"dense": "dense", "moe": "MoE"}  # id -> how messages name it
_RELATIVE = re.compile(r"^x(\d+(?:\.\d+)?|\d+/[1-9]\d*)$")
_ROW_ID = re.compile(r"^[a-z0-9_]+$")


class GridError(ValueError):
    """A grid that cannot be run. ``str()`` is the one-line message for the user."""

    def __init__(
        self, file: str | Path, message: str, row: str | None = None, path: str | None = None
    ) -> None:
        self.file, self.row, self.path, self.message = str(file), row, path, message
        where = [self.file] + ([f"row '{row}'"] if row else []) + ([path] if path else [])
        super().__init__(": ".join(where + [message]))


class _GridLoader(yaml.SafeLoader):
    """SafeLoader that reads ``2e-3`` as a float (YAML 1.1 wants ``2.0e-3``)."""


_GridLoader.yaml_implicit_resolvers = {k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_GridLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _where(mark: yaml.Mark) -> str:
    return f"line {mark.line + 1} column {mark.column + 1}"


def _reject_duplicate_keys(file: Path, node: yaml.Node, path: str, row: str | None) -> None:
    """Walk the composed YAML tree; PyYAML would silently keep the last of two equal keys."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, yaml.Mark] = {}
        for key_node, value_node in node.value:
            key = key_node.value
            key_path = f"{path}.{key}" if path else key
            if key in seen:
                raise GridError(
                    file,
                    f"duplicate key '{key}' at {_where(key_node.start_mark)} (first at {_where(seen[key])})",
                    row,
                    key_path,
                )
            seen[key] = key_node.start_mark
            _reject_duplicate_keys(file, value_node, key_path, row)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            item_row = row
            if path == "rows" and isinstance(item, yaml.MappingNode):
                ids = [v.value for k, v in item.value if k.value == "id" and isinstance(v, yaml.ScalarNode)]
                item_row = ids[0] if ids else f"rows[{i}]"
            _reject_duplicate_keys(file, item, "" if item_row != row else f"{path}[{i}]", item_row)


def read_yaml(file: Path) -> Any:
    """Parse a YAML file strictly: duplicate keys rejected, ``2e-3`` read as a float.

    Raises:
        GridError: unreadable file, malformed YAML (with its line), or a duplicate key.
    """
    try:
        text = file.read_text()
    except OSError as err:
        raise GridError(file, f"cannot read: {err.strerror}") from None
    loader = _GridLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            raise GridError(file, "is empty")
        _reject_duplicate_keys(file, node, "", None)
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise GridError(file, f"malformed YAML: {line}{problem}") from None
    finally:
        loader.dispose()


@dataclass(frozen=True)
class Row:
    """One row of a paper table: overrides of the base, and where the paper reports it."""

    id: str
    label: str
    overrides: dict[str, Any]
    paper_row: int | None = None
    requires: tuple[str, ...] = ()
    compare_to: str | None = None
    """The row this one's Δ PPL and added parameters are measured against (default: the grid's
    ``baseline_row``); Table 2 compares each 48-layer row with the 48-layer baseline, say."""


@dataclass(frozen=True)
class Cell:
    """One trainable unit: a row at a scale with one seed."""

    grid: str
    scale: str
    row: Row
    seed: int
    config: RunConfig
    run_key: str
    unsupported: str | None = None
    """Why the cell cannot run with this code base (e.g. it needs the MoE base), else None."""


@dataclass
class Grid:
    """A parsed grid file. ``cells()`` expands and validates one scale of it."""

    file: Path
    name: str
    title: str
    base: dict[str, Any]
    scales: dict[str, dict[str, Any]]
    rows: list[Row]
    seeds: list[int]
    baseline_row: str
    paper_table: str | None = None
    columns: tuple[str, ...] = ("gate_score",)
    """Probe columns the Markdown / LaTeX table shows beside PPL (see :data:`TABLE_COLUMNS`)."""
    eval: EvalConfig = field(default_factory=lambda: EvalConfig())
    """Benchmarks run on every finished run (``eval:`` in the grid; ``sweep.bench_eval``)."""

    def row_ids(self) -> list[str]:
        return [r.id for r in self.rows]

    def resolve(self, scale: str, row: Row | None, seed: int) -> RunConfig:
        """The row's RunConfig at ``scale`` for ``seed`` (``row=None``: base + scale alone).

        Raises:
            GridError: naming ``scales.<scale>.<key>`` when base + scale are invalid by
                themselves, else the row and the key path, with the scale.
        """
        merged = _deep_merge(self.base, self.scales[scale], "", row=None, file=self.file)
        if row is None:
            try:
                return from_dict(RunConfig, {**merged, "seed": seed})
            except ConfigError as err:
                raise GridError(self.file, err.message, path=f"scales.{scale}.{err.path}") from None
        merged = _deep_merge(merged, row.overrides, "", row=row.id, file=self.file)
        try:
            return from_dict(RunConfig, {**merged, "seed": seed})
        except ConfigError as err:
            raise GridError(self.file, f"{err.message} (at scale '{scale}')", row.id, err.path) from None

    def cells(self, scale: str, seeds: list[int] | None = None, rows: list[str] | None = None) -> list[Cell]:
        """Every (row, seed) cell of ``scale``, validated, in the grid's row order.

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
            chosen = [r for r in self.rows if r.id in rows]
        out = []
        for row in chosen:
            missing = [f for f in row.requires if f not in SUPPORTED_FEATURES]
            for seed in seeds if seeds is not None else self.seeds:
                cfg = self.resolve(scale, row, seed)
                names = "/".join(KNOWN_FEATURES[f] for f in missing)
                why = f"needs the {names} base (not built yet)" if missing else None
                out.append(Cell(self.name, scale, row, seed, cfg, run_key(cfg), why))
        return out

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


def run_key(cfg: RunConfig) -> str:
    """16 hex chars of sha256 over the canonical JSON of the resolved config (seed included)
    and the corpus recipe hash (which also covers source pins and the stdlib's Python version)."""
    payload = {"config": to_dict(cfg), "corpus": recipe_hash(cfg.data)}
    blob = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _deep_merge(base: dict, over: dict, path: str, row: str | None, file: Path) -> dict:
    """``base`` updated by ``over`` recursively; ``xN`` strings scale the base's number."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        key_path = f"{path}.{key}" if path else key
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value, key_path, row, file)
        elif isinstance(value, str) and _RELATIVE.match(value):
            out[key] = _scaled(out.get(key), Fraction(_RELATIVE.match(value).group(1)), key_path, row, file)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _scaled(current: Any, factor: Fraction, path: str, row: str | None, file: Path) -> int | float:
    """``current * factor``, exact for integers (``x12/7`` of 28 layers is 48, not 47.99...)."""
    if isinstance(current, bool) or not isinstance(current, (int, float)):
        raise GridError(
            file, f"'x{factor}' needs a number set by base or scale, found {current!r}", row, path
        )
    if isinstance(current, int):
        value = current * factor
        if value.denominator != 1:
            raise GridError(
                file, f"impossible shape: {current} x {factor} = {float(value):g} is not whole", row, path
            )
        return int(value)
    return current * float(factor)


def paper_csv(name: str) -> Path:
    """``sweep/paper/<name>.csv``: the paper's own numbers, shipped with the package."""
    return Path(str(resources.files("sweep").joinpath("paper", f"{name}.csv")))


def _require_mapping(file: Path, value: Any, path: str, row: str | None = None) -> dict:
    if not isinstance(value, dict):
        raise GridError(file, f"must be a mapping, got {type(value).__name__}", row, path)
    return value


def _parse_seeds(file: Path, value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return list(range(value))
    if (
        isinstance(value, list)
        and value
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in value)
        and len(set(value)) == len(value)
    ):
        return list(value)
    raise GridError(
        file, f"must be a positive count or a list of distinct integers >= 0, got {value!r}", path="seeds"
    )


def _parse_row(file: Path, index: int, raw: Any, seen: set[str]) -> Row:
    raw = _require_mapping(file, raw, f"rows[{index}]")
    rid = raw.get("id")
    if not isinstance(rid, str) or not _ROW_ID.match(rid):
        raise GridError(file, f"needs an 'id' of [a-z0-9_], got {rid!r}", path=f"rows[{index}].id")
    if rid in seen:
        raise GridError(file, "duplicate row id", rid, "id")
    seen.add(rid)
    for key in raw:
        if key not in ROW_KEYS:
            raise GridError(file, f"unknown key; known row keys: {', '.join(sorted(ROW_KEYS))}", rid, key)
    label = raw.get("label", rid)
    if not isinstance(label, str):
        raise GridError(file, "must be a string", rid, "label")
    requires = raw.get("requires", [])
    if not isinstance(requires, list) or any(
        not isinstance(f, str) or f not in KNOWN_FEATURES for f in requires
    ):
        raise GridError(file, f"must be a list of {', '.join(sorted(KNOWN_FEATURES))}", rid, "requires")
    paper_row = raw.get("paper_row")
    if paper_row is not None and (isinstance(paper_row, bool) or not isinstance(paper_row, int)):
        raise GridError(file, "must be an integer", rid, "paper_row")
    compare_to = raw.get("compare_to")
    if compare_to is not None and not isinstance(compare_to, str):
        raise GridError(file, "must be a row id", rid, "compare_to")
    overrides = {k: _require_mapping(file, raw[k], k, rid) for k in SECTION_KEYS if k in raw}
    return Row(rid, label, overrides, paper_row, tuple(requires), compare_to)


def load_grid(file: str | Path) -> Grid:
    """Parse and check a grid file (structure, row ids, every cell of every scale).

    Raises:
        GridError: with the file, row and key path of the first problem found.
    """
    file = Path(file)
    raw = _require_mapping(file, read_yaml(file), "(top level)")
    for key in raw:
        if key not in GRID_KEYS:
            raise GridError(file, f"unknown key; known keys: {', '.join(sorted(GRID_KEYS))}", path=key)
    if "inherit" in raw:
        raw = _inherit(file, raw)
    for key in ("name", "base", "scales", "rows"):
        if key not in raw:
            raise GridError(file, f"missing required key '{key}'", path=key)
    base = _require_mapping(file, raw["base"], "base")
    for section in base:
        if section not in SECTION_KEYS:
            raise GridError(
                file, f"unknown key; known: {', '.join(sorted(SECTION_KEYS))}", path=f"base.{section}"
            )
    scales = _require_mapping(file, raw["scales"], "scales")
    if not scales:
        raise GridError(file, "defines no scale", path="scales")
    for name, body in scales.items():
        for section in _require_mapping(file, body or {}, f"scales.{name}"):
            if section not in SECTION_KEYS:
                raise GridError(
                    file,
                    f"unknown key; known: {', '.join(sorted(SECTION_KEYS))}",
                    path=f"scales.{name}.{section}",
                )
    if not isinstance(raw["rows"], list) or not raw["rows"]:
        raise GridError(file, "must be a non-empty list of rows", path="rows")
    seen: set[str] = set()
    rows = [_parse_row(file, i, r, seen) for i, r in enumerate(raw["rows"])]
    paper = raw.get("paper_table")
    if paper is not None and not (isinstance(paper, str) and paper_csv(paper).is_file()):
        known = sorted(p.name.removesuffix(".csv") for p in paper_csv("").parent.iterdir())
        raise GridError(file, f"unknown paper table {paper!r}; known: {', '.join(known)}", path="paper_table")
    baseline = raw.get("baseline_row", "baseline")
    if baseline not in seen:
        raise GridError(file, f"names no row of the grid: '{baseline}'", path="baseline_row")
    for row in rows:
        if row.compare_to is not None and row.compare_to not in seen:
            raise GridError(file, f"names no row of the grid: '{row.compare_to}'", row.id, "compare_to")
    grid = Grid(
        file=file,
        name=str(raw["name"]),
        title=str(raw.get("title", raw["name"])),
        base=base,
        scales={k: v or {} for k, v in scales.items()},
        rows=rows,
        seeds=_parse_seeds(file, raw.get("seeds", 1)),
        baseline_row=baseline,
        paper_table=paper,
        columns=_parse_columns(file, raw.get("columns", ["gate_score"])),
        eval=_parse_eval(file, raw.get("eval") or {}),
    )
    for scale in grid.scales:
        grid.cells(scale)
    return grid


def _inherit(file: Path, raw: dict) -> dict:
    """``raw`` with the inherited grid's ``base`` and ``scales`` beneath its own (deep-merged)."""
    ref = raw["inherit"]
    if not isinstance(ref, str):
        raise GridError(file, "must be a path to another grid file", path="inherit")
    parent_file = file.parent / ref
    if not parent_file.is_file():
        raise GridError(file, f"inherited grid {parent_file} does not exist", path="inherit")
    parent = _require_mapping(parent_file, read_yaml(parent_file), "(top level)")
    if "inherit" in parent:
        raise GridError(file, f"{parent_file} inherits in turn; one level only", path="inherit")
    merged = dict(raw)
    for key in ("base", "scales"):
        mine = _require_mapping(file, raw.get(key) or {}, key)
        theirs = _require_mapping(parent_file, parent.get(key) or {}, key)
        merged[key] = _deep_merge(theirs, mine, key, None, file)
    return merged


@dataclass(frozen=True)
class EvalConfig:
    """The grid's ``eval:`` section: lm-eval tasks run on each finished run's ``final.ckpt``.

    ``tasks``: names of the offline suite (``sweep.bench_suite``: ``offline_mmlu_dev``,
    ``offline_humaneval``; ``offline_wikihow`` and ``offline_mathqa`` download BIG-bench) or any
    lm-eval task name (those need the hub). ``num_fewshot``: per task (default 0). ``limit``:
    documents per task (None: all). ``batch_size`` and ``max_gen_toks`` go to the model wrapper.
    """

    tasks: tuple[str, ...] = ()
    num_fewshot: tuple[tuple[str, int], ...] = ()
    limit: int | None = None
    batch_size: int = 32
    max_gen_toks: int = 64

    def fewshot(self, task: str) -> int:
        return dict(self.num_fewshot).get(task, 0)


def _parse_eval(file: Path, value: Any) -> EvalConfig:
    if not isinstance(value, dict):
        raise GridError(file, f"must be a mapping; got {value!r}", path="eval")
    for key in value:
        if key not in EVAL_KEYS:
            raise GridError(file, f"unknown key; allowed: {', '.join(sorted(EVAL_KEYS))}", path=f"eval.{key}")
    tasks = value.get("tasks", [])
    if (
        not isinstance(tasks, list)
        or not all(isinstance(t, str) and t for t in tasks)
        or len(set(tasks)) < len(tasks)
    ):
        raise GridError(file, f"must be a list of distinct task names; got {tasks!r}", path="eval.tasks")
    shots = value.get("num_fewshot", {})
    if not isinstance(shots, dict) or any(t not in tasks or not _count(n, 0) for t, n in shots.items()):
        raise GridError(file, f"must map listed tasks to counts >= 0; got {shots!r}", path="eval.num_fewshot")
    for key, low in (("limit", 1), ("batch_size", 1), ("max_gen_toks", 1)):
        if key in value and not (key == "limit" and value[key] is None) and not _count(value[key], low):
            raise GridError(file, f"must be an integer >= {low}; got {value[key]!r}", path=f"eval.{key}")
    return EvalConfig(
        tasks=tuple(tasks),
        num_fewshot=tuple(sorted(shots.items())),
        limit=value.get("limit"),
        batch_size=value.get("batch_size", 32),
        max_gen_toks=value.get("max_gen_toks", 64),
    )


def _count(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _parse_columns(file: Path, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or any(c not in TABLE_COLUMNS for c in value):
        raise GridError(file, f"must be a list of {', '.join(TABLE_COLUMNS)}; got {value!r}", path="columns")
    return tuple(value)
