"""The one sanitiser between data and a terminal.

Store documents, state files, manifests and paths are data, not output: a release named
`\\x1b]0;owned\\x07` must not retitle the operator's window, and `\\u202e` must not reverse what a
line appears to say. Every such string passes `printable` before a human-readable line: control
characters (C0 but tab, DEL, C1) and the Unicode bidirectional controls are shown escaped, the way
Python writes them (`\\x1b`, `\\u202e`). A line break is escaped too, so data cannot forge a line.
`--json` keeps the exact strings (JSON escapes them itself).
"""

from __future__ import annotations

import re

# C0 but tab, DEL, C1; the bidi embeddings, overrides and isolates, marks (LRM, RLM, ALM); and the
# line and paragraph separators, which some terminals break on.
# Lone surrogates too: no terminal encoding can write them.
UNSAFE = re.compile(
    "[\x00-\x08\x0a-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]"
)


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object) -> str:
    """text as one line that shows every character and controls none."""
    shown = text if isinstance(text, str) else str(text)
    if shown.isascii() and shown.isprintable():
        return shown  # the common case, without a regex pass
    return UNSAFE.sub(_escaped, shown)


def is_printable(text: str) -> bool:
    """Whether printable would leave text as it is."""
    return UNSAFE.search(text) is None
