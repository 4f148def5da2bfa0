"""wire.py: an ExtenderArgs body cut before NodeNames, never to a meaning
the whole body does not have."""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from cgpud.extender.wire import Cut, cut_node_names


def parts(cut: Cut) -> Any:
    """What the extender makes of a cut: the pod object with NodeNames
    added, or None when either part does not parse (it then parses the
    whole body)."""
    try:
        pod, names = orjson.loads(cut.pod), orjson.loads(cut.names)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(pod, dict) or not pod or "NodeNames" in pod:
        return None
    pod["NodeNames"] = names
    return pod


def test_go_encoding_is_cut_before_node_names() -> None:
    body = b'{"Pod":{"metadata":{"name":"p"}},"Nodes":null,"NodeNames":["a","b"]}'
    cut = cut_node_names(body)
    assert cut == Cut(b'{"Pod":{"metadata":{"name":"p"}},"Nodes":null}', b'["a","b"]')
    assert parts(cut) == orjson.loads(body)
    spaced = b'{"Pod": {}, "NodeNames" : ["a"]}'  # a space before the colon: not cut, parsed whole
    assert cut_node_names(spaced) is None
    assert cut_node_names(b'{"Pod": {}, "NodeNames": ["a"] }\r\n') == Cut(b'{"Pod": {}}', b'["a"]')


def test_bodies_that_are_not_cut() -> None:
    for body in (
        b'{"NodeNames":["a"],"Pod":{}}',  # not the last member
        b'{"Pod":{},"NodeNames":null}',  # not a list
        b'{"NodeNames":["a"]}',  # nothing before it
        b'["NodeNames":["a"]]',
        b"",
        b"}",
    ):
        assert cut_node_names(body) is None, body


def test_a_cut_at_the_wrong_place_does_not_parse() -> None:
    # The key's text inside a string: its first quote is escaped there.
    body = json.dumps({"Pod": {}, 'x,"NodeNames': ["y"]}, separators=(",", ":")).encode()
    assert cut_node_names(body) is None
    body = json.dumps({"Pod": {}, "NodeNames": ["a"], "x": 'b","NodeNames":["c"]'}, separators=(",", ":")).encode()
    assert cut_node_names(body) is None
    # `{,"NodeNames":[...]}` is no JSON, though `{}` and the list each are.
    cut = cut_node_names(b'{,"NodeNames":["a"]}')
    assert cut is not None and parts(cut) is None
    # A NodeNames member in the pod part too.
    cut = cut_node_names(b'{"NodeNames":["a"],"NodeNames":["b"]}')
    assert cut is not None and parts(cut) is None


_pieces = st.sampled_from(['"NodeNames":', "NodeNames", "]", "}", ",", '"', "\\", "[", "{", ":", " ", "a", "é"])
_strings = st.lists(_pieces, max_size=5).map("".join)
_names = st.lists(_strings, max_size=4)
_values = st.recursive(
    st.none() | st.booleans() | st.integers() | _strings,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_strings, inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=400, deadline=None)
@given(
    pod=st.dictionaries(_strings, _values, max_size=3),
    names=_names,
    separators=st.sampled_from([(",", ":"), (", ", ": "), (",", ": ")]),
    cut_at=st.integers(min_value=0, max_value=400),
    insert=_pieces,
)
def test_a_cut_body_means_what_the_whole_body_means(
    pod: dict[str, Any], names: list[str], separators: tuple[str, str], cut_at: int, insert: str
) -> None:
    text = json.dumps({**pod, "NodeNames": names}, separators=separators, ensure_ascii=False)
    # The body as sent, and the body with a piece of text inserted somewhere
    # (often no JSON any more, or JSON of another meaning).
    for body in (text, text[:cut_at] + insert + text[cut_at:]):
        raw = body.encode()
        cut = cut_node_names(raw)
        if cut is None:
            continue
        got = parts(cut)
        try:
            whole = orjson.loads(raw)
        except orjson.JSONDecodeError:
            assert got is None, body
            continue
        assert got is None or got == whole, body
