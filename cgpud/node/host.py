"""Facts about this host that the daemon reports or keys on."""

from __future__ import annotations

import socket
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str:
    """Changes at every boot: tells a reboot from a daemon restart."""
    return BOOT_ID.read_text().strip()


def hostname() -> str:
    return socket.gethostname()


def primary_address() -> str:
    """The IPv4 address the node's default route leaves from, as `kubectl
    inspect cgpu` shows it; the first global address if there is no default
    route; "" if the node has none."""
    from pyroute2 import IPRoute  # 90 ms to import: paid by the first status call, not every start

    with IPRoute() as ip:
        for route in ip.get_default_routes(family=socket.AF_INET):
            src = route.get_attr("RTA_PREFSRC")
            if src:
                return str(src)
            oif = route.get_attr("RTA_OIF")
            for addr in ip.get_addr(family=socket.AF_INET, index=oif):
                return str(addr.get_attr("IFA_ADDRESS"))
        for addr in ip.get_addr(family=socket.AF_INET):
            if addr["scope"] == 0:  # RT_SCOPE_UNIVERSE: not loopback or link-local
                return str(addr.get_attr("IFA_ADDRESS"))
    return ""
