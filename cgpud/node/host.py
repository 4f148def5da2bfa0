"""Facts about this host that the daemon reports or keys on."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from pathlib import Path

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
_OUTSIDE = "1.1.1.1"  # any global unicast address the node has no nearer route to
_SIOCGIFADDR = 0x8915


def boot_id() -> str:
    """Changes at every boot: tells a reboot from a daemon restart."""
    return BOOT_ID.read_text().strip()


def hostname() -> str:
    return socket.gethostname()


def primary_address() -> str:
    """The IPv4 address the default route leaves from, as `kubectl
    inspect cgpu` shows it; the first global address if there is no default
    route; "" if the node has none."""
    return _default_route_source() or next(iter(global_addresses()), "")


def _default_route_source() -> str:
    # The kernel's own choice of source for a destination only the default
    # route covers (its preferred source, else its device's address);
    # connecting a UDP socket sends nothing. Not the netlink library this
    # used to import, which cost every node start 120 ms of CPU.
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((_OUTSIDE, 9))
        except OSError:  # no route: no default one
            return ""
        return str(s.getsockname()[0])


def global_addresses() -> list[str]:
    """Each interface's primary IPv4 address, in interface order, but
    loopback and link-local ones."""
    out = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("16s16x", name.encode()[:15])
            try:
                answer = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:  # no IPv4 address
                continue
            address = ipaddress.IPv4Address(answer[20:24])
            if not (address.is_loopback or address.is_link_local or address.is_unspecified):
                out.append(str(address))
    return out
