"""cgpud/boundedhttp.py's decisions over real sockets: who is cut at the
cap, when an idle connection is reaped, what the body budget lets in."""

from __future__ import annotations

import socket

import pytest

from cgpud.boundedhttp import Bounds, Budget, ConnectionTable


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair()


def cut(peer: socket.socket) -> bool:
    """The server side was shut down: its peer reads EOF."""
    peer.settimeout(0.5)
    return peer.recv(1) == b""


def test_at_the_cap_the_longest_idle_connection_makes_room_and_busy_ones_are_never_cut() -> None:
    clock = Clock()
    table = ConnectionTable(Bounds(max_connections=3, idle_timeout=30), clock)
    pairs = [pair() for _ in range(5)]
    for i, (ours, _) in enumerate(pairs[:3]):
        clock.now = i
        assert table.admit(ours)
    table.busy(pairs[0][0])  # the oldest is being answered
    assert table.admit(pairs[3][0]) and len(table) == 3
    assert cut(pairs[1][1])  # the longest idle one went, not the busy one
    table.busy(pairs[2][0])
    table.busy(pairs[3][0])
    assert not table.admit(pairs[4][0])  # all answered: the newcomer is refused
    table.idle(pairs[0][0])
    assert table.admit(pairs[4][0]) and cut(pairs[0][1])


def test_an_idle_connection_is_reaped_after_the_bound_counted_from_when_it_went_idle() -> None:
    clock = Clock()
    table = ConnectionTable(Bounds(max_connections=8, idle_timeout=10), clock)
    (a, a_peer), (b, b_peer) = pair(), pair()
    table.admit(a)
    table.admit(b)
    table.busy(b)
    clock.now = 9
    table.idle(b)  # answered at 9: idle from then
    clock.now = 10.5
    assert table.reap() == 1 and cut(a_peer) and len(table) == 1
    clock.now = 19.5
    assert table.reap() == 1 and cut(b_peer) and len(table) == 0


def test_the_body_budget_is_shared_and_given_back() -> None:
    budget = Budget(100)
    assert budget.take(60) and not budget.take(50) and budget.take(40)
    budget.give(60)
    assert budget.take(50)


@pytest.mark.parametrize("bounds", [dict(max_connections=0), dict(idle_timeout=0), dict(body_budget=-1)])
def test_bounds_that_make_no_sense_are_refused(bounds: dict) -> None:
    with pytest.raises(ValueError, match="bad HTTP server bounds"):
        Bounds(**bounds)
