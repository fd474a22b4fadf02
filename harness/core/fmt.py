"""Small text formatting helpers shared by the CLI and the reports."""

from __future__ import annotations

from typing import Iterable


def id_ranges(ids: Iterable[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2,5,7-8'."""
    values = sorted(set(ids))
    parts: list[str] = []
    start = prev = None
    for v in values:
        if start is None:
            start = prev = v
        elif v == prev + 1:  # type: ignore[operator]
            prev = v
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = v
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts) or "-"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A plain fixed-width text table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def number(value: float) -> str:
    """The one rendering of a float in reports: '0', '0.5432', '12.35', '1.2e+05', '3.4e-04'."""
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    if value == 0:
        return "0"
    if abs(value) < 1e-3 or abs(value) >= 1e5:
        return f"{value:.2e}"
    return f"{value:.4g}"


def multiple(value: float) -> str:
    """A ratio to a noise floor, short: '0.54x', '12x', '350x', '1.1e12x' (never '1115135825994.2x')."""
    if value != value or value in (float("inf"), float("-inf")):
        return f"{value}x"
    if value == 0:
        return "0x"
    if abs(value) >= 1e4 or abs(value) < 1e-2:
        mantissa, exponent = f"{value:.1e}".split("e")
        return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}x"
    if abs(value) >= 100:
        return f"{value:.0f}x"
    return f"{value:.2g}x" if abs(value) < 10 else f"{value:.1f}".rstrip("0").rstrip(".") + "x"
