"""A suite's `checks:` against the check registry (harness/checks/catalog.py): which sections exist, which
keys each takes, and CheckSettings, every section's settings resolved for one dtype.

A section with a settings class (CheckSpec.settings) is parsed by harness/compare/settings.py's
parse_section (flat keys for every dtype, per-dtype sub-mappings overriding them, unknown keys rejected
with "did you mean"); a section without one takes only `enabled`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, TypeVar

from harness.checks.catalog import sections
from harness.compare.settings import SETTINGS_DTYPES, parse_section
from harness.core.errors import ConfigError
from harness.core.paths import SUITES_DIR
from harness.specs.loader import did_you_mean
from harness.specs.suite import ENABLED_KEY, Suite, read_suite

T = TypeVar("T")


def validate_suite_checks(suite: Suite) -> None:
    """Every `checks:` key of `suite` names a registered section whose settings parse (unknown keys and
    bad values rejected, every dtype sub-section included), and a section without settings sets nothing but
    `enabled` (a key that nothing reads is rejected, not ignored)."""
    _parsed(suite, SETTINGS_DTYPES[0])


def _parsed(suite: Suite, dtype: str) -> dict[str, Any]:
    """Every registered section's settings for `dtype`, from `suite` (defaults where it sets none), the
    suite's `checks:` keys validated on the way (validate_suite_checks)."""
    where = f"suite {suite.name!r}"
    known = sections()
    for check, settings in suite.checks.items():
        if check not in known:
            raise ConfigError(f"{where}: unknown check {check!r}{did_you_mean(check, tuple(known))}; "
                              f"valid checks: {', '.join(known)}")
        unread = sorted(str(k) for k in (settings or {}) if k != ENABLED_KEY)
        if known[check] is None and unread:
            raise ConfigError(f"{where}: checks.{check} takes only {ENABLED_KEY!r}, got {', '.join(unread)}"
                              + (" (GSM8K settings go under the suite's top-level gsm8k:)"
                                 if check == "gsm8k" else ""))
    # parse_section validates every key and dtype sub-section; `dtype` only picks the values
    return {name: parse_section(cls, f"{where}: checks.{name}", suite.check_settings(name), dtype)
            for name, cls in known.items() if cls is not None}


def load_suite(ref: str, folder: Path = SUITES_DIR) -> Suite:
    """A suite by shipped name or by path to a suite YAML, its `checks:` validated against the registry."""
    suite = read_suite(ref, folder)
    validate_suite_checks(suite)
    return suite


def _defaults(dtype: str) -> dict[str, Any]:
    return {name: parse_section(cls, name, None, dtype) for name, cls in sections().items() if cls is not None}


@dataclass(frozen=True)
class CheckSettings:
    """The resolved settings of every registered section for one dtype, by section name; a check reads
    its own with `of(ItsSettings)`."""

    dtype: str = "float32"
    sections: Mapping[str, Any] = field(default_factory=lambda: _defaults("float32"))

    def of(self, cls: type[T]) -> T:
        """The settings of the section that parses into `cls`."""
        found = [value for value in self.sections.values() if type(value) is cls]
        if len(found) != 1:
            raise ConfigError(f"no single check section has settings {cls.__name__}; sections: "
                              f"{', '.join(self.sections)}")
        return found[0]  # type: ignore[no-any-return]

    @classmethod
    def from_suite(cls, suite: Suite, dtype: str) -> "CheckSettings":
        if dtype not in SETTINGS_DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r}{did_you_mean(dtype, SETTINGS_DTYPES)}; "
                              f"valid: {', '.join(SETTINGS_DTYPES)}")
        return cls(dtype=dtype, sections=_parsed(suite, dtype))
