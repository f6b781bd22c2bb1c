"""Reading a grid file: strict YAML (duplicate keys rejected, ``2e-3`` a float) and the one error
type every grid problem raises, :class:`GridError`, whose message names the file, the row and the
key path on one line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml


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
            if not isinstance(key_node, yaml.ScalarNode):
                raise GridError(
                    file,
                    f"keys must be names, not a {key_node.id} ({_where(key_node.start_mark)})",
                    row,
                    path,
                )
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
