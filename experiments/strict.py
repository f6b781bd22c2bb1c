"""Strict construction of typed dataclasses from plain mappings (parsed YAML), and back.

The one loader every configuration goes through: run configs (``experiments.config``) and the grid
schema (``sweep.grid``). Unknown keys, wrong types and bad enum values are rejected with the allowed
values listed; each dataclass's ``__post_init__`` adds its own checks by raising
:class:`ConfigError`, whose ``path`` is the dotted key path of the offending value.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal, TypeVar, get_args, get_origin


class ConfigError(ValueError):
    """A user error in a configuration value.

    Attributes:
        path: dotted key path of the offending value, e.g. ``"model.gate.position"``.
        message: what is wrong, including the allowed values where there is a fixed set.
    """

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)

    def under(self, prefix: str) -> ConfigError:
        """The same error with ``prefix`` prepended to its key path."""
        if not prefix:
            return self
        if not self.path:
            return ConfigError(prefix, self.message)
        return ConfigError(prefix + ("" if self.path.startswith("[") else ".") + self.path, self.message)


T = TypeVar("T")


def check_literals(obj: Any) -> None:
    """Check every ``Literal``-typed field of the dataclass instance ``obj``.

    Raises:
        ConfigError: naming the field and the allowed values.
    """
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        allowed = get_args(hints[f.name]) if get_origin(hints[f.name]) is Literal else None
        if allowed is not None and getattr(obj, f.name) not in allowed:
            raise ConfigError(
                f.name, f"bad value '{getattr(obj, f.name)}'; allowed: {', '.join(map(str, allowed))}"
            )


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check ``value`` against the annotation ``tp`` and build nested dataclasses."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        if len(options) != 1:  # X | Y would depend on the order tried: validate it as Any instead
            raise TypeError(
                f"unsupported annotation {tp!r} at {path}; use X | None, or Any and __post_init__"
            )
        if value is None:
            if len(options) < len(get_args(tp)):
                return None
            raise ConfigError(path, "must not be empty")
        return _coerce(value, options[0], path)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(path, f"must be a mapping, got {type(value).__name__}")
        return from_dict(tp, value, path)
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(path, f"bad value '{value}'; allowed: {', '.join(map(str, allowed))}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"must be a list, got {type(value).__name__}")
        (item_tp, _ellipsis) = get_args(tp)
        return tuple(_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"must be a mapping, got {type(value).__name__}")
        key_tp, item_tp = get_args(tp)
        prefix = f"{path}." if path else ""
        return {_coerce(k, key_tp, path): _coerce(v, item_tp, f"{prefix}{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(path, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(path, f"must be a number, got {value!r}")
        if not math.isfinite(value):  # .nan / .inf pass every range check that follows
            raise ConfigError(path, f"must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(path, f"must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported annotation {tp!r} at {path}")  # internal: a new field type


def from_dict(cls: type[T], data: dict[str, Any], path: str = "") -> T:
    """Build ``cls`` from a mapping, strictly.

    Raises:
        ConfigError: a key that is not a string, an unknown key (the known ones listed), a missing
            required field, a wrong type, a bad enum value, or any check of the dataclass's
            ``__post_init__``; its ``path`` is the dotted key path.
    """
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    names = [f.name for f in fields]
    prefix = f"{path}." if path else ""
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(path, f"keys must be names, got {key!r}")
        if key not in names:
            raise ConfigError(f"{prefix}{key}", f"unknown key; known keys: {', '.join(names)}")
    for f in fields:
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in data:
            raise ConfigError(f"{prefix}{f.name}", "missing required key")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.under(path) from None


def identity_dict(obj: Any) -> Any:
    """:func:`to_dict` without the fields a dataclass lists in its ``KEYED_WHEN_SET`` class
    attribute while they hold their default: options added after runs were keyed, so adding one
    leaves every existing run key and corpus hash as it was."""
    if dataclasses.is_dataclass(obj):
        late = getattr(type(obj), "KEYED_WHEN_SET", ())
        return {
            f.name: identity_dict(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if not (f.name in late and getattr(obj, f.name) == f.default)
        }
    return to_dict(obj)


def to_dict(obj: Any) -> Any:
    """Plain, YAML/JSON-ready form of a config tree (tuples become lists)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
