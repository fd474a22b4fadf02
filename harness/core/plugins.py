"""Objects named by "module:attribute" strings, and the ones packages register through entry points
(the `harness.backends` and `harness.checks` groups): imported only when asked for."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any


@dataclass(frozen=True)
class Registered:
    """One entry point of a group: its name, its "module:attribute" target and the distribution that
    registered it."""

    name: str
    target: str
    origin: str


def load_target(target: str) -> Any:
    """The object `target` ("package.module:attribute.path") names, its module imported now."""
    module, _, attr = target.partition(":")
    obj: Any = import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def registered(group: str) -> list[Registered]:
    """Every entry point of `group` in the installed distributions, in their order."""
    return [Registered(ep.name, ep.value, ep.dist.name if ep.dist is not None else "entry point")
            for ep in entry_points(group=group)]
