"""Reading a grid file: strict YAML (duplicate keys rejected, ``2e-3`` a float), the file's own
syntax (``inherit:``, relative values ``x2`` / ``x12/7``) and the one error type every grid problem
raises, :class:`GridError`, whose message names the file, the row and the key path on one line.

A path may name a file that is not a grid at all (a symlink to a password file, a typo'd
``GRID=``): no message quotes such a file's text. YAML's own messages lose what they quote from
the file (an alias, a tag: ``!secret`` on a line of its own is a tag), and a file whose top level
holds none of a grid's keys is refused as "not a grid" before any of its keys or values is named.
"""

from __future__ import annotations

import ast
import copy
import os
import re
import stat
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

_RELATIVE = re.compile(r"^x(\d+(?:\.\d+)?|\d+/[1-9]\d*)$")
#: A grid, scale or benchmark task name: it becomes a file name (``results/<grid>_<scale>.md``),
#: an MLflow experiment or metric name and part of MLflow / Optuna filter strings, so nothing a
#: path, a URL or a query would read as syntax.
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
MAX_SEEDS = 1000  # a count beyond any study's, and beyond what the cell list holds in memory


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


#: The tag PyYAML gives a ``<<`` key: YAML's merge key, which copies an anchored mapping's keys.
MERGE_TAG = "tag:yaml.org,2002:merge"
#: Largest grid file read (bytes): a real grid is a few kilobytes.
MAX_BYTES = 1_000_000

#: Values a grid may hold once its aliases (``*name``) are expanded: a real grid has a few
#: hundred; nested aliases ("billion laughs") would otherwise hang the loader.
MAX_VALUES = 100_000
#: Deepest nesting a grid may have: a real grid has about six levels. Checked on the composed
#: nodes, so the refusal does not hang on Python's recursion limit, which other code may raise.
MAX_DEPTH = 64
_TOO_DEEP = "is nested too deeply (a grid needs a few levels)"


def _reject_duplicate_keys(
    file: Path, node: yaml.Node, path: str, row: str | None, budget: list[int] | None = None
) -> None:
    """Walk the composed YAML tree; PyYAML would silently keep the last of two equal keys.

    Raises:
        GridError: a duplicate or non-scalar key, or more than :data:`MAX_VALUES` values.
    """
    budget = [MAX_VALUES] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        raise GridError(file, f"holds more than {MAX_VALUES:,} values once its aliases are expanded")
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, yaml.Mark] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise GridError(
                    file,
                    f"keys must be names, not a {key_node.id} ({_where(key_node.start_mark)})",
                    row,
                    path,
                )
            key = key_node.value
            if key_node.tag == MERGE_TAG:  # `<<: *anchor`: the anchor's keys, overridden by this mapping's
                _reject_duplicate_keys(file, value_node, path, row, budget)
                continue
            if key_node.tag != "tag:yaml.org,2002:str":  # `1:`, `true:`, `null:` read as a number...
                raise GridError(
                    file, f"keys must be names, not {key!r} ({_where(key_node.start_mark)})", row, path
                )
            key_path = f"{path}.{key}" if path else key
            if key in seen:
                raise GridError(
                    file,
                    f"duplicate key '{key}' at {_where(key_node.start_mark)} (first at {_where(seen[key])})",
                    row,
                    key_path,
                )
            seen[key] = key_node.start_mark
            _reject_duplicate_keys(file, value_node, key_path, row, budget)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            item_row = row
            if path == "rows" and isinstance(item, yaml.MappingNode):
                ids = [v.value for k, v in item.value if k.value == "id" and isinstance(v, yaml.ScalarNode)]
                item_row = ids[0] if ids else f"rows[{i}]"
            _reject_duplicate_keys(file, item, "" if item_row != row else f"{path}[{i}]", item_row, budget)


def _read_bounded(file: Path) -> bytes:
    """The bytes of a regular file of at most :data:`MAX_BYTES`; a FIFO, a device or a folder
    would block or never end, so they are refused before anything is read.

    Raises:
        GridError: not a regular file, or larger than :data:`MAX_BYTES`.
        OSError: the file cannot be read.
    """
    if not stat.S_ISREG(os.stat(file).st_mode):
        raise GridError(file, "is not a regular file (a grid is a YAML file)")
    with open(file, "rb") as handle:
        data = handle.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise GridError(file, f"is larger than {MAX_BYTES:,} bytes; a grid is a small YAML file")
    return data


_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'" + r'|"(?:[^"\\]|\\.)*"')  # PyYAML's %r of a str


def _unquoted(problem: str) -> str:
    """PyYAML's ``problem`` without the file's text it quotes: a token's name (``'<scalar>'``)
    and a single character stay (as ``U+0009`` when not printable); longer quoted text (an alias,
    a tag, an anchor: a password's first line may read as one) is left out."""

    def shown(match: re.Match) -> str:
        quoted = match.group(0)
        if quoted[1:-1].startswith("<") and quoted[1:-1].endswith(">"):
            return quoted
        try:
            text = ast.literal_eval(quoted)
        except (ValueError, SyntaxError):
            return ""
        if isinstance(text, str) and len(text) == 1:
            return quoted if text.isprintable() and not text.isspace() else f"U+{ord(text):04X}"
        return ""

    out = _QUOTED.sub(shown, problem)
    out = re.sub(r"\s+([),;:])", r"\1", re.sub(r"\(\s*\)", "", re.sub(r"  +", " ", out)))
    return re.sub(r"[:,]\)", ")", out).strip()


def _depth(node: yaml.Node) -> int:
    """The deepest nesting under ``node``, each node walked once (aliases share nodes)."""
    deepest, seen, todo = 0, set(), [(node, 1)]
    while todo:
        here, depth = todo.pop()
        if id(here) in seen:
            continue
        seen.add(id(here))
        deepest = max(deepest, depth)
        if isinstance(here, yaml.SequenceNode):
            todo.extend((child, depth + 1) for child in here.value)
        elif isinstance(here, yaml.MappingNode):
            todo.extend((child, depth + 1) for pair in here.value for child in pair)
    return deepest


def _holds_a_key(node: yaml.Node, keys: tuple[str, ...]) -> bool:
    """Whether ``node`` is a mapping with at least one of ``keys`` at its top level."""
    return isinstance(node, yaml.MappingNode) and any(
        isinstance(k, yaml.ScalarNode) and k.value in keys for k, _ in node.value
    )


def read_yaml(file: Path, keys: tuple[str, ...] | None = None) -> Any:
    """Parse a YAML file strictly: duplicate keys rejected, ``2e-3`` read as a float. With
    ``keys`` (a grid's top-level keys), a file whose top level is not a mapping holding one of
    them is refused as not a grid before anything in it is checked, so that no message quotes it.

    Raises:
        GridError: unreadable file, malformed YAML (with its line), a duplicate key, or not a
            grid; no message quotes more than one character of the file unless it is a grid.
    """
    try:
        text = _read_bounded(file).decode("utf-8")
    except OSError as err:
        raise GridError(file, f"cannot read: {err.strerror}") from None
    except UnicodeDecodeError as err:
        bad = err.object[err.start]
        raise GridError(file, f"is not UTF-8 text (byte {err.start} is {bad:#04x})") from None
    try:
        loader = _GridLoader(text)  # refuses characters YAML does not allow (a NUL byte) here
    except yaml.reader.ReaderError as err:
        where = f"line {text.count(chr(10), 0, err.position) + 1}"
        code = err.character if isinstance(err.character, int) else ord(err.character)
        raise GridError(file, f"malformed YAML: {where}: character U+{code:04X} is not allowed") from None
    try:
        node = loader.get_single_node()
        if node is None:
            raise GridError(file, "is empty")
        if _depth(node) > MAX_DEPTH:
            raise GridError(file, _TOO_DEEP)
        if keys is not None and not _holds_a_key(node, keys):
            shown = ", ".join(keys[:4])
            raise GridError(file, f"is not a grid: its top level holds none of a grid's keys ({shown})")
        _reject_duplicate_keys(file, node, "", None)
        return loader.construct_document(node)
    except GridError:  # a ValueError too: not one of YAML's
        raise
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f"line {mark.line + 1}: " if mark else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise GridError(file, f"malformed YAML: {line}{_unquoted(problem)}") from None
    except RecursionError:  # PyYAML composes and constructs recursively
        raise GridError(file, _TOO_DEEP) from None
    except ValueError as err:  # a value YAML reads but Python cannot hold: an int of 5,000 digits
        first = str(err).splitlines()[0].split("; ")[0]
        raise GridError(file, f"malformed YAML: {_unquoted(first)}") from None
    finally:
        loader.dispose()


def deep_merge(base: dict, over: dict, path: str, row: str | None, file: Path) -> dict:
    """``base`` updated by ``over`` recursively; ``xN`` strings scale the base's number.

    ``path`` (the key path of ``over``), ``row`` and ``file`` only name the place in errors.

    Raises:
        GridError: ``xN`` on a value that is not a number, or a whole number made fractional.
    """
    out = copy.deepcopy(base)
    for key, value in over.items():
        key_path = f"{path}.{key}" if path else key
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value, key_path, row, file)
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


def inherit(file: Path, raw: dict, keys: tuple[str, ...] | None = None) -> dict:
    """``raw`` (the parsed ``file``) with the inherited grid's ``base`` and ``scales`` beneath its own
    (deep-merged); one level only.

    Raises:
        GridError: ``inherit`` is not a path to a readable grid file, or that grid inherits too.
    """
    ref = raw["inherit"]
    if not isinstance(ref, str):
        raise GridError(file, "must be a path to another grid file", path="inherit")
    parent_file = file.parent / ref
    if not parent_file.is_file():
        raise GridError(file, f"inherited grid {parent_file} does not exist", path="inherit")
    parent = read_yaml(parent_file, keys)
    if not isinstance(parent, dict):
        raise GridError(parent_file, "must be a mapping", path="(top level)")
    if "inherit" in parent:
        raise GridError(file, f"{parent_file} inherits in turn; one level only", path="inherit")
    merged = dict(raw)
    for key in ("base", "scales"):
        mine, theirs = raw.get(key) or {}, parent.get(key) or {}
        for where, value in ((file, mine), (parent_file, theirs)):
            if not isinstance(value, dict):
                raise GridError(where, f"must be a mapping, got {type(value).__name__}", path=key)
        merged[key] = deep_merge(theirs, mine, key, None, file)
    return merged
