"""The node's primary address (node/host.py), read in network namespaces of
its own (unshare -n, as root; veth pairs, as the kernel here has no dummy
devices): what the default route leaves from, else the first global
address, else nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

REPORT = "from cgpud.node import host; print(host.primary_address())"


def primary_in_netns(setup: str) -> str:
    script = f"set -e\nip link set lo up\n{setup}\nexec {sys.executable} -c '{REPORT}'"
    out = subprocess.run(["unshare", "--net", "sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def link(name: str, address: str) -> str:
    """A veth pair, both ends up, `address` on `name`."""
    return f"ip link add {name} type veth peer name p{name} && ip link set {name} up && ip link set p{name} up\n" + (
        f"ip addr add {address} dev {name}\n"
    )


LINK_LOCAL_FIRST = link("d1", "169.254.3.3/16") + link("d0", "10.9.0.5/24")


@pytest.mark.parametrize(
    ("setup", "expected"),
    [
        pytest.param("", "", id="loopback-only"),
        pytest.param(LINK_LOCAL_FIRST, "10.9.0.5", id="no-default-route"),
        pytest.param(LINK_LOCAL_FIRST + "ip route add default via 10.9.0.1 dev d0", "10.9.0.5", id="default-route"),
        pytest.param(
            LINK_LOCAL_FIRST + link("d2", "10.7.0.9/24") + "ip route add default via 10.7.0.1 dev d2",
            "10.7.0.9",
            id="default-route-not-on-the-first-interface",
        ),
        pytest.param(
            LINK_LOCAL_FIRST + "ip addr add 10.9.1.7/24 dev d0\nip route add default via 10.9.0.1 dev d0 src 10.9.1.7",
            "10.9.1.7",
            id="preferred-source",
        ),
        pytest.param(LINK_LOCAL_FIRST + "ip route add blackhole default", "10.9.0.5", id="blackhole-default-route"),
    ],
)
def test_the_primary_address_is_where_the_default_route_leaves_from(setup: str, expected: str) -> None:
    assert primary_in_netns(setup) == expected
