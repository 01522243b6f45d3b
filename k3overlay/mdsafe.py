"""Upstream's text (paths, diffs, git's messages) placed into markdown without changing its
structure: a context line of three backticks in a diff must not close the fence it is
shown in, a path holding ``</details>`` or a backtick must not close the collapsed block
or the code span around it, and a line feed in a message must not start a heading.
"""

from __future__ import annotations

import html
import re

_BACKTICKS = re.compile(r"`+")
_BREAKS = re.compile(r"[\r\n\x0b\x0c\x85\u2028\u2029]+")
_BLOCK_TAG = re.compile(r"<(?=/?\s*(?:details|summary)\b)", re.IGNORECASE)


def _longest_run(text: str) -> int:
    return max((len(m[0]) for m in _BACKTICKS.finditer(text)), default=0)


def one_line(text: str) -> str:
    """``text`` on one line: each run of line breaks becomes a space."""
    return _BREAKS.sub(" ", text)


def code(text: str) -> str:
    """An inline code span of ``text`` (one line), fenced with more backticks than any run
    in it and padded where it starts or ends with one (CommonMark strips one space)."""
    text = one_line(text)
    fence = "`" * (_longest_run(text) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") or not text.strip() else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def fenced(lines: list[str], info: str = "") -> list[str]:
    """``lines`` as a fenced code block whose fence (3 backticks or more) is longer than
    any backtick run in them, so none of them can close it."""
    fence = "`" * max(3, _longest_run("\n".join(lines)) + 1)
    return [fence + info, *lines, fence]


def text(value: str) -> str:
    """Plain text on one line, HTML-escaped (``<``, ``>``, ``&``): no tag of upstream's can
    open or close a block (``</details>``), in a list item or a ``<summary>``."""
    return html.escape(one_line(value), quote=False)


def block(value: str) -> str:
    """Markdown of our own (a section's details) that may quote upstream's names: every
    ``<details>``/``<summary>`` tag in it, opening or closing, is escaped."""
    return _BLOCK_TAG.sub("&lt;", value)
