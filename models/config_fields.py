"""Field checks shared by the config dataclasses: types, ranges, building from a mapping, a stable hash.

Torch-free, like :mod:`models.config`, whose dataclasses call these from ``__post_init__``; errors
are :class:`models.errors.ConfigError` naming the offending field, so a bad run-config file or
command-line override says what to fix.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Iterator, Mapping, Union, get_args, get_origin, get_type_hints

from models.errors import ConfigError

__all__ = ["stable_hash", "fields", "type_ok", "check_types", "positive", "non_negative", "from_dict"]


def stable_hash(data: Any) -> str:
    """A 16-hex-digit sha256 of ``data``'s canonical JSON: the same on every machine and process."""
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def fields(obj_or_cls: Any) -> Iterator[tuple[str, Any]]:
    """``(name, resolved type hint)`` of each field of a dataclass or its instance."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield f.name, hints[f.name]


def type_ok(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits ``hint`` (floats must be finite; a bool is not an int)."""
    if get_origin(hint) is Union:
        return any(type_ok(value, h) for h in get_args(hint))
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


def check_types(obj: Any) -> None:
    """Raise :class:`ConfigError` for the first field of ``obj`` whose value does not fit its type; an int
    given for a float field becomes that float (TOML writes ``1`` for ``1.0``)."""
    for name, hint in fields(obj):
        value = getattr(obj, name)
        if not type_ok(value, hint):
            want = getattr(hint, "__name__", str(hint))
            raise ConfigError(name, f"expected {want}, got {value!r}")
        if hint is float and isinstance(value, int):
            object.__setattr__(obj, name, float(value))


def positive(obj: Any, *names: str) -> None:
    """Raise :class:`ConfigError` unless each named field of ``obj`` is > 0."""
    for name in names:
        if getattr(obj, name) <= 0:
            raise ConfigError(name, f"must be > 0, got {getattr(obj, name)}")


def non_negative(obj: Any, *names: str) -> None:
    """Raise :class:`ConfigError` unless each named field of ``obj`` is >= 0."""
    for name in names:
        if getattr(obj, name) < 0:
            raise ConfigError(name, f"must be >= 0, got {getattr(obj, name)}")


def from_dict(cls: type, data: Any, prefix: str) -> Any:
    """Build the dataclass ``cls`` from a nested mapping, nested dataclasses included; an unknown key or
    a bad value raises :class:`ConfigError` naming the field by its dotted path after ``prefix``."""
    if not isinstance(data, Mapping):
        raise ConfigError(prefix.rstrip(".") or cls.__name__, "must be a table of fields")
    known = dict(fields(cls))
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(prefix + unknown[0], f"unknown field (known: {', '.join(known)})")
    kwargs = {}
    for name, value in data.items():
        hint = known[name]
        if dataclasses.is_dataclass(hint):
            kwargs[name] = from_dict(hint, value, prefix + name + ".")
        else:
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if prefix and not e.field.startswith(prefix):
            raise ConfigError(prefix + e.field, str(e).split(": ", 1)[1]) from None
        raise
