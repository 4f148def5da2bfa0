"""An ExtenderArgs body cut in two without parsing the node list: the pod
(everything but NodeNames) and NodeNames's raw JSON text. Pure.

kube-scheduler's Go encoder writes the fields in struct order, NodeNames
last: `{"Pod":{...},"Nodes":null,"NodeNames":["a","b",...]}`. At 5,000
nodes that list is most of the body, and the same list comes pod after pod:
the extender keeps the names it parsed and checked per list text, and finds
them again by the text's bytes instead of parsing and hashing 5,000 strings.

Why the cut is safe for any bytes a client sends: JSON's grammar has one
parse. If `pod` (the text before `,"NodeNames":` closed with `}`) parses as
a non-empty object without a NodeNames member, and `names` parses as a
value, the whole body is that object with the member NodeNames = that
value appended, and nothing else. A cut at the wrong place (the key's text
inside a string, say) makes one of the two parts fail to parse, and the
caller parses the whole body instead.
"""

from __future__ import annotations

from typing import NamedTuple

_KEY = b'"NodeNames":'
_SPACE = b" \t\r\n"


class Cut(NamedTuple):
    pod: bytes  # the body without its NodeNames member, as a JSON object
    names: bytes  # NodeNames's value as it was sent: `[...]`


def cut_node_names(body: bytes) -> Cut | None:
    """The body cut before its last member when that member is NodeNames
    and its value is a list; None otherwise (parse the whole body). Whether
    both parts parse is the caller's check (see the module's docstring)."""
    end = body.rstrip(_SPACE)
    if not end.endswith(b"}"):
        return None
    at = end.rfind(_KEY)
    if at < 0:
        return None
    names = end[at + len(_KEY) : -1].strip(_SPACE)
    if not (names.startswith(b"[") and names.endswith(b"]")):
        return None
    head = end[:at].rstrip(_SPACE)
    if not head.endswith(b","):
        return None
    return Cut(head[:-1] + b"}", names)
