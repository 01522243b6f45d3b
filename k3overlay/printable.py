"""Text from upstream (paths, subjects, git's messages) made safe for a terminal.

A path or a commit subject is upstream's to choose, and a terminal acts on what it is
sent: ESC starts a CSI or OSC sequence (colours, a moved cursor, a retitled window, a
hyperlink, a cleared screen), ``\\r`` and backspace overwrite what was printed, C1 controls
are CSI and OSC in one byte, and BiDi overrides reorder what is shown. Each such character
is shown as its escape (``\\x1b``, ``\\u202e``) instead; line feeds and tabs stay.
"""

from __future__ import annotations

import re

_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with every control character but ``\\n`` and ``\\t`` (C0, DEL, C1) and every
    BiDi control written as its Python escape."""
    if not isinstance(text, str):
        return text
    return _UNPRINTABLE.sub(lambda m: m[0].encode("unicode_escape").decode("ascii"), text)
