"""Log tails for display: terminal colour codes removed, characters XML forbids replaced."""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
_XML_FORBIDDEN = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def clean_log(text: str) -> str:
    """The log without ANSI escape sequences and without control characters (tab and newline kept)."""
    return xml_safe(_ANSI.sub("", text))


def xml_safe(text: str) -> str:
    """Text without the characters XML 1.0 forbids (each replaced by U+FFFD)."""
    return _XML_FORBIDDEN.sub("\ufffd", text)
