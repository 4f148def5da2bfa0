"""Kubernetes resource quantities ("2", "1500m", "4Gi", "1e3"), as the API
server writes them: a decimal number and at most one suffix, binary (Ki..Ei),
decimal (n..E) or an exponent."""

from __future__ import annotations

import re
from decimal import Decimal

_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_QUANTITY = re.compile(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))((?:[eE][+-]?[0-9]+)|Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]?)")


def parse_quantity(text: str) -> Decimal:
    """The quantity's exact value; ValueError if `text` is not one."""
    m = _QUANTITY.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not a quantity")
    number, suffix = Decimal(m.group(1)), m.group(2)
    if suffix in _BINARY:
        return number * (1024 ** _BINARY[suffix])
    if suffix in _DECIMAL:
        return number.scaleb(_DECIMAL[suffix])
    return number.scaleb(int(suffix[1:]))
