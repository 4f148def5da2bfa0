"""Certificates for TLS tests, made with the openssl CLI: a CA, a server
certificate for the given IPs (and localhost), a client certificate of the
same CA, and an untrusted client whose certificate another CA signed."""

from __future__ import annotations

import ssl
import subprocess
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence


@dataclass(frozen=True)
class Pki:
    """`node_cert(name)` issues a node's own Capacity server certificate."""

    ca: Path  # the trusted CA's certificate
    ca_key: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    untrusted_ca: Path  # another CA
    untrusted_cert: Path  # a client certificate that CA signed
    untrusted_key: Path
    dir: Path

    def node_cert(self, node: str, ips: Sequence[str] = ("127.0.0.1",)) -> tuple[Path, Path]:
        """(certificate, key) of a node's Capacity server: the Node's name as
        a DNS subjectAltName (what cgpu-scheduler checks), and its IPs."""
        cert, key = self.dir / f"node-{node}.crt", self.dir / f"node-{node}.key"
        if not cert.exists():
            san = ",".join([f"DNS:{node}", *(f"IP:{ip}" for ip in ips)])
            cert, key = leaf(self.dir, f"node-{node}", (self.ca, self.ca_key), "serverAuth", san)
        return cert, key

    def client_context(
        self, cert: Path | None = None, key: Path | None = None, *, anonymous: bool = False
    ) -> ssl.SSLContext:
        """A client's TLS context: trusts the CA, shows `cert` (the client
        certificate unless another is given), or none when `anonymous`."""
        context = ssl.create_default_context(cafile=str(self.ca))
        if not anonymous:
            context.load_cert_chain(cert or self.client_cert, key or self.client_key)
        return context


def _openssl(*args: str) -> None:
    done = subprocess.run(["openssl", *args], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {done.stderr}")


def _new_key(key: Path) -> tuple[str, ...]:
    """`openssl req` arguments for a new unencrypted P-256 key written to `key`."""
    return ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key))


def ca(dir: Path, name: str) -> tuple[Path, Path]:
    cert, key = dir / f"{name}.crt", dir / f"{name}.key"
    _openssl(
        "req",
        "-x509",
        *_new_key(key),
        "-out",
        str(cert),
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    return cert, key


def leaf(
    dir: Path, name: str, ca: tuple[Path, Path], usage: str, san: str, subject: str | None = None
) -> tuple[Path, Path]:
    """A certificate `ca` signed; the subject is /CN=<name> unless given
    (Kubernetes reads a client's user from CN and its groups from O)."""
    cert, key, csr, ext = dir / f"{name}.crt", dir / f"{name}.key", dir / f"{name}.csr", dir / f"{name}.ext"
    _openssl(
        "req",
        *_new_key(key),
        "-out",
        str(csr),
        "-subj",
        subject or f"/CN={name}",
    )
    ext.write_text(
        f"basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage={usage}\n"
        f"subjectAltName={san}\n"
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca[0]),
        "-CAkey",
        str(ca[1]),
        "-CAcreateserial",
        "-out",
        str(cert),
        "-days",
        "2",
        "-extfile",
        str(ext),
    )
    return cert, key


def make_pki(
    dir: Path, server_ips: Sequence[str] = ("127.0.0.1",), server_names: Sequence[str] = ("localhost",)
) -> Pki:
    dir.mkdir(parents=True, exist_ok=True)
    trusted = ca(dir, "cgpu-test-ca")
    other = ca(dir, "other-ca")
    san = ",".join([*(f"IP:{ip}" for ip in server_ips), *(f"DNS:{n}" for n in server_names)])
    server = leaf(dir, "server", trusted, "serverAuth", san)
    client = leaf(dir, "client", trusted, "clientAuth", "DNS:cgpu-scheduler")
    untrusted = leaf(dir, "untrusted", other, "clientAuth", "DNS:intruder")
    return Pki(
        ca=trusted[0],
        ca_key=trusted[1],
        server_cert=server[0],
        server_key=server[1],
        client_cert=client[0],
        client_key=client[1],
        untrusted_ca=other[0],
        untrusted_cert=untrusted[0],
        untrusted_key=untrusted[1],
        dir=dir,
    )
