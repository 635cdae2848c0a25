"""What text from a user may hold where it reaches a script or a message: defined once for every side.

A file name or value with a newline would end a line of a batch script and start a command; in a
message it would break the one line a user is promised. Stdlib only.
"""

from __future__ import annotations

import re

#: What no key, value or file name that reaches a script may contain: C0 and C1 control characters
#: (newlines among them), Unicode's line and paragraph separators, and lone surrogates (undecodable
#: bytes of a file name).
CONTROL_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def has_control_chars(text: str) -> bool:
    return bool(CONTROL_CHARS.search(text))


def one_line(text: str) -> str:
    """``text`` with every character that is not printable (newlines, escapes, lone surrogates, bidi
    overrides) written as its Python escape: a message that names a hostile file name or value stays
    one line, and shows what is really there."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
