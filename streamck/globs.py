"""Globs over tensor names, checked before use: shared by rewrite's rules and diff's --ignore."""

from __future__ import annotations

from streamck.errors import PlanError


def check_glob(glob: str) -> None:
    """fnmatch reads any string, silently treating an unclosed ``[`` as a literal and a
    reversed range as empty; both are almost always typos, so refuse them."""
    if not glob:
        raise PlanError("empty glob")
    i = 0
    while (i := glob.find("[", i)) >= 0:
        j = i + 1 + (glob[i + 1 : i + 2] == "!")
        close = glob.find("]", j + 1)
        if close < 0:
            raise PlanError(f"invalid glob {glob!r}: '[' at {i} is never closed")
        body = glob[j:close]
        for k in range(1, len(body) - 1):
            if body[k] == "-" and body[k - 1] > body[k + 1]:
                raise PlanError(f"invalid glob {glob!r}: reversed range {body[k - 1]}-{body[k + 1]}")
        i = close + 1
