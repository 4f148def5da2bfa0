"""cgpud/kube/rest.py against a real HTTPS peer that asks for a client
certificate (the openssl-made PKI of tests/harness/tls.py), and the
kubeconfigs it takes and refuses."""

from __future__ import annotations

import base64
import json
import ssl
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from cgpud.kube.quantity import parse_quantity
from cgpud.kube.rest import CredentialsError, RestClient, RestError, server_from
from tests.harness.net import send_json, serving
from tests.harness.tls import Pki, make_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@contextmanager
def https_server(pki: Pki) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """An API server's stand-in on 127.0.0.1 that wants a client certificate of
    the PKI's CA: GET answers the path and the Authorization header it saw,
    anything under /missing a 404 Status."""
    seen: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append({"path": self.path, "auth": self.headers.get("Authorization")})
            if self.path.startswith("/missing"):
                send_json(self, 404, json.dumps({"kind": "Status", "message": 'pods "x" not found'}).encode())
            else:
                send_json(self, 200, json.dumps({"path": self.path}).encode())

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(pki.server_cert), str(pki.server_key))
    context.load_verify_locations(str(pki.ca))
    context.verify_mode = ssl.CERT_REQUIRED
    server.socket = context.wrap_socket(server.socket, server_side=True)
    with serving(server) as port:
        yield f"https://127.0.0.1:{port}", seen


def b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def kubeconfig(tmp_path: Path, cluster: dict[str, Any], user: dict[str, Any]) -> Path:
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "c",
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "clusters": [{"name": "k", "cluster": cluster}],
                "users": [{"name": "u", "user": user}],
            }
        )
    )
    return path


def file_client(tmp_path: Path, url: str, ca: Path, cert: Path, key: Path) -> RestClient:
    """A client of a kubeconfig that names its CA, certificate and key as files."""
    config = kubeconfig(
        tmp_path,
        {"server": url, "certificate-authority": str(ca)},
        {"client-certificate": str(cert), "client-key": str(key)},
    )
    return RestClient(server_from(config), timeout=5)


def test_a_client_certificate_in_the_kubeconfig_is_presented_and_the_ca_checked(tmp_path: Path, pki: Pki) -> None:
    with https_server(pki) as (url, seen):
        config = kubeconfig(
            tmp_path,
            {"server": url, "certificate-authority-data": b64(pki.ca)},
            {"client-certificate-data": b64(pki.client_cert), "client-key-data": b64(pki.client_key)},
        )
        client = RestClient(server_from(config), timeout=5)
        try:
            assert client.call("GET", "/api/v1/nodes/{name}", {"name": "a b/c"}) == {"path": "/api/v1/nodes/a%20b%2Fc"}
            with pytest.raises(RestError) as missing:
                client.call("GET", "/missing")
            assert (missing.value.status, missing.value.reason) == (404, 'pods "x" not found')
        finally:
            client.close()
        # A certificate another CA signed gets no answer: the handshake fails.
        client = file_client(tmp_path, url, pki.ca, pki.untrusted_cert, pki.untrusted_key)
        with pytest.raises(RestError) as refused:
            client.call("GET", "/api/v1/nodes")
        assert refused.value.status == 0 and "cannot be reached" in refused.value.reason
        client.close()
    assert [s["auth"] for s in seen] == [None, None]


def test_a_server_certificate_of_another_ca_is_refused(tmp_path: Path, pki: Pki) -> None:
    with https_server(pki) as (url, seen):
        client = file_client(tmp_path, url, pki.untrusted_ca, pki.client_cert, pki.client_key)
        with pytest.raises(RestError, match="CERTIFICATE_VERIFY_FAILED"):
            client.call("GET", "/api/v1/nodes")
        client.close()
    assert seen == []


def test_a_token_and_a_token_file_relative_to_the_kubeconfig_are_sent(tmp_path: Path, pki: Pki) -> None:
    (tmp_path / "tokens").mkdir()
    (tmp_path / "tokens" / "t").write_text("from-file\n")
    with https_server(pki) as (url, seen):
        cluster = {"server": url, "certificate-authority": str(pki.ca)}
        cert = {"client-certificate": str(pki.client_cert), "client-key": str(pki.client_key)}
        for user in ({**cert, "token": "inline"}, {**cert, "tokenFile": "tokens/t"}):
            client = RestClient(server_from(kubeconfig(tmp_path, cluster, user)), timeout=5)
            client.call("GET", "/api/v1/nodes")
            client.close()
    assert [s["auth"] for s in seen] == ["Bearer inline", "Bearer from-file"]


@pytest.mark.parametrize(
    "cluster, user, message",
    [
        ({"server": "https://h:6443"}, {"exec": {"command": "aws"}}, "uses exec credentials, which cgpu does not run"),
        ({"server": "https://h:6443"}, {"auth-provider": {"name": "gcp"}}, "uses auth-provider credentials"),
        ({"server": "h:6443"}, {}, "has no https:// server"),
        ({"server": "https://h:6443", "certificate-authority": "nowhere.crt"}, {}, "cannot use its certificates"),
    ],
)
def test_kubeconfigs_cgpu_cannot_use_are_refused_with_the_reason(tmp_path, cluster, user, message) -> None:
    with pytest.raises(CredentialsError, match=message) as e:
        server_from(kubeconfig(tmp_path, cluster, user))
    assert str(e.value).startswith("cannot load the API server's credentials: kubeconfig ")


def test_a_kubeconfig_without_its_context_or_file_and_no_pod_are_refused(tmp_path, monkeypatch) -> None:
    (tmp_path / "empty").write_text("apiVersion: v1\nkind: Config\n")
    with pytest.raises(CredentialsError, match="no context None"):
        server_from(tmp_path / "empty")
    with pytest.raises(CredentialsError, match="does not exist"):
        server_from(tmp_path / "missing")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(CredentialsError, match="not in a pod"):
        server_from(None)


@pytest.mark.parametrize(
    "text, value",
    [
        ("2", 2),
        ("1500m", Decimal("1.5")),
        ("4Gi", 4 << 30),
        ("512Mi", 512 << 20),
        ("1e3", 1000),
        ("100M", 100_000_000),
        (".5", Decimal("0.5")),
        ("1Ki", 1024),
        ("3E", 3 * 10**18),
    ],
)
def test_quantities_read_as_the_api_server_writes_them(text: str, value: Decimal) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "1Gii", "1 Gi", "abc", "1e", "1.2.3", "0x10"])
def test_what_is_not_a_quantity_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_quantity(text)


class RawServer:
    """A server on 127.0.0.1 that answers each request on a connection with
    the next of `answers` (raw bytes) and closes the connection after those
    marked close; it counts the connections and the requests it read."""

    def __init__(self, answers: list[tuple[bytes, bool]]) -> None:
        import socket
        import threading

        self.answers = list(answers)
        self.connections = 0
        self.requests: list[bytes] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while self.answers:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn, conn.makefile("rb") as rfile:
                while self.answers:
                    head = b""
                    while not head.endswith(b"\r\n\r\n"):
                        line = rfile.readline()
                        if not line:
                            break
                        head += line
                    if not head:
                        break
                    length = 0
                    for line in head.split(b"\r\n"):
                        if line.lower().startswith(b"content-length:"):
                            length = int(line.split(b":")[1])
                    self.requests.append(head + rfile.read(length))
                    answer, close = self.answers.pop(0)
                    conn.sendall(answer)
                    if close:
                        break

    def client(self, tmp_path: Path) -> RestClient:
        path = kubeconfig(tmp_path, {"server": f"http://127.0.0.1:{self.port}"}, {"token": "t"})
        return RestClient(server_from(path), 5.0)


def test_whole_answers_come_over_one_kept_connection_chunked_or_not(tmp_path: Path) -> None:
    server = RawServer(
        [
            (b'HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n{"a": 1}', False),
            (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                b'4;x=y\r\n{"b"\r\n3\r\n: 2\r\n1\r\n}\r\n0\r\nTrailer: t\r\n\r\n',
                False,
            ),
            (b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}", True),
            (b'HTTP/1.1 200 OK\r\n\r\n{"to": "the end"}', True),  # no length: to the close
        ]
    )
    client = server.client(tmp_path)
    assert client.call("GET", "/api/v1/a") == {"a": 1}
    assert client.call("GET", "/api/v1/b") == {"b": 2}
    client.send("POST", "/api/v1/namespaces/{ns}/things", {"ns": "n s"}, {"x": 1})
    assert server.connections == 1  # kept until the server said close
    assert client.call("GET", "/api/v1/c") == {"to": "the end"}
    assert server.connections == 2
    post = server.requests[2]
    assert post.startswith(b"POST /api/v1/namespaces/n%20s/things HTTP/1.1\r\n")
    assert b"Authorization: Bearer t\r\n" in post and post.endswith(b'\r\n\r\n{"x": 1}')
    client.close()


def test_a_kept_connection_the_server_closed_is_not_used_and_bad_answers_are_errors(tmp_path: Path) -> None:
    import time

    status = b'{"kind":"Status","message":"not here"}'
    server = RawServer(
        [
            (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}", True),  # closed without saying so
            (b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(status), status), False),
            (b"SSH-2.0-OpenSSH\r\n\r\n", True),
        ]
    )
    client = server.client(tmp_path)
    assert client.call("GET", "/one") == {}
    time.sleep(0.2)  # the server's close arrives
    with pytest.raises(RestError) as e:
        client.call("GET", "/two")
    assert e.value.status == 404 and e.value.reason == "not here"
    assert server.connections == 2
    with pytest.raises(RestError) as e:
        client.call("GET", "/three")
    assert e.value.status == 0 and "not HTTP/1.x" in e.value.reason
