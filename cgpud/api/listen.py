"""The Capacity API's listen settings: TCP endpoints as settings spell them
("HOST:PORT", an IPv6 host in brackets: "[::1]:9455") and the rules on
TLS files and plaintext. No grpc here: config validation uses it at start,
before the API is imported."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from cgpud.errors import UsageError

# Listening on these means every address of the node.
WILDCARD_HOSTS = ("0.0.0.0", "::")


@dataclass(frozen=True)
class Endpoint:
    host: str  # without brackets
    port: int

    def __str__(self) -> str:
        return join_host_port(self.host, self.port)

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    @property
    def wildcard(self) -> bool:
        return self.host in WILDCARD_HOSTS


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: only this node's processes reach it."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _is_ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def parse_endpoint(text: str, setting: str, *, port_optional: bool = False) -> Endpoint:
    """ "HOST:PORT" (IPv6 in brackets); with `port_optional`, "HOST" alone
    too (port 0: the caller's). UsageError naming `setting` otherwise."""
    text = text.strip()
    named = f"{setting} {text!r}" if setting.startswith("--") else f"setting {setting} = {text!r}"
    usage = f"{named} is not HOST:PORT (an IPv6 address in brackets: [::1]:9455)" + (
        " or HOST" if port_optional else ""
    )
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise UsageError(usage)
        host, rest = text[1:close], text[close + 1 :]
        if not _is_ipv6(host):
            raise UsageError(f"{usage}: {host!r} in brackets is not an IPv6 address")
        if not rest and port_optional:
            return Endpoint(host, 0)
        if not rest.startswith(":"):
            raise UsageError(usage)
        port_text = rest[1:]
    else:
        if text.count(":") > 1:
            if port_optional and _is_ipv6(text):
                return Endpoint(text, 0)
            raise UsageError(f"{usage}: put an IPv6 address in brackets")
        host, sep, port_text = text.partition(":")
        if not sep:
            if port_optional and host and not any(c.isspace() for c in host):
                return Endpoint(host, 0)
            raise UsageError(usage)
    if not host or any(c.isspace() for c in host):
        raise UsageError(usage)
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise UsageError(f"{usage}: the port must be a number 0-65535")
    return Endpoint(host, int(port_text))


TLS_SETTINGS = ("capacity_tls_cert", "capacity_tls_key", "capacity_tls_ca")


def tls_problem(cert: str, key: str, ca: str) -> str | None:
    """The TLS files come all three or not at all."""
    unset = [name for name, value in zip(TLS_SETTINGS, (cert, key, ca)) if not value]
    if 0 < len(unset) < len(TLS_SETTINGS):
        return (
            f"TLS for the Capacity API needs capacity_tls_cert, capacity_tls_key and capacity_tls_ca together; "
            f"{', '.join(unset)} {'is' if len(unset) == 1 else 'are'} not set"
        )
    return None


def plaintext_problem(endpoint: Endpoint, tls: bool, insecure: bool) -> str | None:
    """Why this listen address may not serve plaintext; None when it may."""
    if tls or insecure or endpoint.loopback:
        return None
    return (
        f"capacity_listen = {str(endpoint)!r} is not a loopback address, and the Capacity API serves plaintext "
        "only on loopback: set capacity_tls_cert, capacity_tls_key and capacity_tls_ca (client certificates "
        "are required), or capacity_insecure = true to serve plaintext to the network anyway"
    )
