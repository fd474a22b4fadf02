"""Build frozen dataclasses from YAML mappings, rejecting unknown keys with "did you mean"."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Mapping, TypeVar

import yaml

from harness.core.errors import ConfigError

T = TypeVar("T")


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """A ' (did you mean X?)' suffix when a close match exists, else ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_keys(where: str, data: Mapping[str, Any], allowed: list[str] | tuple[str, ...],
               required: tuple[str, ...] = ()) -> None:
    """Reject unknown keys and missing required ones, naming them and what is valid."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}: {data!r}")
    for key in data:
        if key not in allowed:
            raise ConfigError(
                f"{where}: unknown key {key!r}{did_you_mean(str(key), allowed)}; "
                f"valid keys: {', '.join(sorted(allowed))}")
    for key in required:
        if key not in data:
            raise ConfigError(f"{where}: missing required key {key!r}")


def expect_mapping(where: str, data: Any) -> Mapping[str, Any]:
    """`data` (a document's top level or a section of it) when it is a mapping, else a ConfigError naming its type."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of key: value, got {type(data).__name__}: "
                          f"{_short(data)}")
    return data


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _type_name(tp: Any) -> str:
    """A field type as a user reads it: 'an integer', 'a number', 'a list', ..."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, typing.get_args(tp)))
    names = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
             type(None): "null", tuple: "a list", list: "a list", dict: "a mapping"}
    if tp in names:
        return names[tp]
    if origin in names:
        return names[origin]
    if origin is not None and isinstance(origin, type) and issubclass(origin, (Mapping,)) or tp is Mapping:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _fits(tp: Any, value: Any) -> bool:
    """Whether a YAML value `value` fits the field type `tp` (the container's type, not its items': the field's own
    validation checks those); a type this does not know fits anything."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_fits(a, value) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:  # YAML 1.1 reads 1e-8 (no dot) as a string: a string that is a finite number fits
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            return False
        try:
            return math.isfinite(float(value))
        except (OverflowError, ValueError):  # an int beyond any float, a string that is no number
            return False
    if tp is str:
        return isinstance(value, str)
    if origin in (tuple, list) or tp in (tuple, list):
        return isinstance(value, (list, tuple))
    if origin in (dict, Mapping) or tp in (dict, Mapping) or (isinstance(origin, type) and issubclass(origin, Mapping)):
        return isinstance(value, Mapping)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return isinstance(value, (tp, Mapping))
    return True


def check_types(cls: type, where: str, data: Mapping[str, Any]) -> None:
    """Each value of `data` against its dataclass field's declared type: a wrong one (a string for a number, a list
    for a mapping, a null, an infinite number) is a ConfigError naming the field, the value and the type wanted."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):  # an annotation not resolvable at run time: nothing to check against
        return
    for key, value in data.items():
        tp = hints.get(str(key))
        if tp is not None and not _fits(tp, value):
            raise ConfigError(f"{where}: {key} must be {_type_name(tp)}, got {_short(value)}")


def build(cls: type[T], where: str, data: Mapping[str, Any], **extra: Any) -> T:
    """Construct dataclass `cls` from `data` after checking its keys against the fields and its values' types."""
    fields = [f for f in dataclasses.fields(cls) if f.init and f.name not in extra]  # type: ignore[arg-type]
    names = tuple(f.name for f in fields)
    required = tuple(f.name for f in fields if f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    check_keys(where, data, names, required)
    check_types(cls, where, data)  # type: ignore[arg-type]
    try:
        return cls(**dict(data), **extra)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def load_yaml(path: Path) -> Any:
    """Parse one YAML file, with errors naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not a text YAML file (byte {exc.start} is not UTF-8); "
                          f"give a YAML file of UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc


NAME_RULE = ("a name becomes a file or folder name (run folders, cache entries): one path component, not empty, "
             "not starting with '.', without '/', '\\' or control characters")


def check_path_name(where: str, field: str, value: object) -> str:
    """`value`, a name that becomes one path component (a model's, suite's, engine's or topology's name: run
    folders, cache entries, report folders), or a ConfigError naming it and what is valid. A name with '/'
    (org/model) is refused with the component it could be (org--model), never nested into folders."""
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {field} must be a string, got {value!r}")
    bad = (not value or value.startswith(".") or "/" in value or "\\" in value
           or any(ord(ch) < 32 or ord(ch) == 127 for ch in value) or len(value.encode("utf-8", "replace")) > 200)
    if bad:
        parts = value.split("/")
        hint = (f" (e.g. {'--'.join(parts)!r})" if len(parts) > 1 and all(p and not p.startswith(".") for p in parts)
                else "")
        raise ConfigError(f"{where}: {field}={value!r} is not a valid name; {NAME_RULE}, at most 200 bytes{hint}")
    return value


def expect_int(where: str, name: str, value: Any, minimum: int = 0, maximum: int | None = None) -> int:
    """Validate an integer field (bools rejected), within [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: {name} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{where}: {name}={value} must be >= {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{where}: {name}={value} must be <= {maximum}")
    return value


def read_versioned_list(path: Path, keys: tuple[str, ...], version: int) -> tuple[dict[str, Any], list[Any]]:
    """A baselines YAML file's top level (its keys checked, schema_version required and equal to
    `version`) and its `baselines` list."""
    data = load_yaml(path) or {}
    check_keys(str(path), data, keys, required=("schema_version",))
    if data["schema_version"] != version:
        raise ConfigError(f"{path}: schema_version {data['schema_version']!r}; this harness reads schema_version "
                          f"{version}")
    raw = data.get("baselines") or []
    if not isinstance(raw, list):
        raise ConfigError(f"{path}: baselines must be a list")
    return data, raw
