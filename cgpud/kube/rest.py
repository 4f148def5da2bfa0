"""The Kubernetes API over HTTP(S), as far as cgpu calls it: JSON in, JSON
out, a Status's message as the error, and a watch as a stream of lines.

Credentials come from a kubeconfig (a client certificate, a token or token
file, the cluster's CA, as kubectl writes them) or from the pod's service
account. Exec and auth-provider plugins are refused with a message: cgpud
runs as a node daemon and runs no programs a kubeconfig names.

Not the official client: that one is 126 MiB installed and its import costs
cgpud a third of its start; these are the few calls cgpu makes.

RestClient is thread-safe (kept connections for whole answers, one urllib3
pool for watches); close() ends it."""

from __future__ import annotations

import base64
import json
import os
import select
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import quote, urlencode, urlsplit

import urllib3

from cgpud.errors import CgpuError

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REREAD_S = 60.0  # projected service-account tokens rotate; kubelet renews them well before expiry
JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"


class CredentialsError(CgpuError):
    """No usable credentials: no kubeconfig and not in a pod, or a kubeconfig that cannot be used."""


class RestError(Exception):
    """A call that failed: `status` is the HTTP status the API server
    answered, 0 when it could not be reached; `reason` its Status message."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"{status} {reason}" if status else reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Server:
    """Where the API server is and how to talk to it."""

    url: str  # scheme://host:port, no trailing slash
    tls: ssl.SSLContext | None
    token: Callable[[], str | None]


def server_from(kubeconfig: Path | None = None) -> Server:
    """From a kubeconfig file when one is given, else the pod's service
    account (in-cluster)."""
    if kubeconfig is not None:
        return _from_kubeconfig(kubeconfig)
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    if not host:
        raise CredentialsError(
            "no credentials for the API server: not in a pod (KUBERNETES_SERVICE_HOST is unset) and no kubeconfig given"
        )
    port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    host = f"[{host}]" if ":" in host else host
    ca = SERVICE_ACCOUNT / "ca.crt"
    try:
        context = ssl.create_default_context(cafile=str(ca))
    except OSError as e:
        raise CredentialsError(f"cannot read the service account's CA {ca}: {e.strerror or e}") from e
    return Server(f"https://{host}:{port}", context, _TokenFile(SERVICE_ACCOUNT / "token"))


def _from_kubeconfig(path: Path) -> Server:
    if not path.is_file():
        raise CredentialsError(f"kubeconfig {path} does not exist")
    try:
        return _kubeconfig_server(path)
    except CredentialsError as e:
        raise CredentialsError(f"cannot load the API server's credentials: {e}") from e


def _kubeconfig_server(path: Path) -> Server:
    import yaml  # a kubeconfig file's only: a pod's service account needs none (16 ms to import)

    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise CredentialsError(f"cannot read kubeconfig {path}: {e}") from e
    if not isinstance(config, dict):
        raise CredentialsError(f"kubeconfig {path} is not a mapping")
    base = path.parent
    context_name = config.get("current-context")
    context = _named(config, "contexts", "context", context_name, path)
    cluster = _named(config, "clusters", "cluster", context.get("cluster"), path)
    user = _named(config, "users", "user", context.get("user"), path) if context.get("user") else {}
    for plugin in ("exec", "auth-provider"):
        if plugin in user:
            raise CredentialsError(
                f"kubeconfig {path}: user {context.get('user')!r} uses {plugin} credentials, which cgpu does not run; "
                "give it a client certificate or a token"
            )
    server = str(cluster.get("server") or "").rstrip("/")
    if not server.startswith(("https://", "http://")):
        raise CredentialsError(f"kubeconfig {path}: cluster {context.get('cluster')!r} has no https:// server")
    tls = None
    if server.startswith("https://"):
        tls = _tls(cluster, user, base, path)
    token = user.get("token")
    if token:
        return Server(server, tls, lambda: str(token))
    if user.get("tokenFile"):
        return Server(server, tls, _TokenFile(_relative(base, user["tokenFile"])))
    return Server(server, tls, lambda: None)


def _named(config: dict[str, Any], section: str, key: str, name: Any, path: Path) -> dict[str, Any]:
    for entry in config.get(section) or []:
        if isinstance(entry, dict) and entry.get("name") == name and isinstance(entry.get(key), dict):
            return dict(entry[key])
    what = "current-context" if section == "contexts" else f"{key} of the current context"
    raise CredentialsError(f"kubeconfig {path}: no {key} {name!r} (its {what})")


def _relative(base: Path, name: str) -> Path:
    p = Path(os.path.expanduser(name))
    return p if p.is_absolute() else base / p


def _pem(entry: dict[str, Any], field: str, base: Path) -> bytes | None:
    """The PEM of `field-data` (base64) or of the file `field`."""
    data = entry.get(f"{field}-data")
    if data:
        return base64.b64decode(data)
    if entry.get(field):
        return _relative(base, entry[field]).read_bytes()
    return None


def _tls(cluster: dict[str, Any], user: dict[str, Any], base: Path, path: Path) -> ssl.SSLContext:
    try:
        context = ssl.create_default_context()
        if cluster.get("insecure-skip-tls-verify"):
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        ca = _pem(cluster, "certificate-authority", base)
        if ca is not None:
            context.load_verify_locations(cadata=ca.decode())
        cert, key = _pem(user, "client-certificate", base), _pem(user, "client-key", base)
        if cert is not None and key is not None:
            _load_chain(context, cert, key)
    except (OSError, ValueError, ssl.SSLError) as e:
        raise CredentialsError(f"kubeconfig {path}: cannot use its certificates: {e}") from e
    return context


def _load_chain(context: ssl.SSLContext, cert: bytes, key: bytes) -> None:
    # ssl loads a certificate and key only from files: private ones, gone once loaded.
    with tempfile.TemporaryDirectory(prefix="cgpu-kubeconfig-") as d:
        cert_file, key_file = Path(d) / "cert.pem", Path(d) / "key.pem"
        for file, data in ((cert_file, cert), (key_file, key)):
            fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
        context.load_cert_chain(str(cert_file), str(key_file))


class _TokenFile:
    """The token in a file, read again every TOKEN_REREAD_S seconds. Thread-safe."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._token = ""
        self._read_at = -TOKEN_REREAD_S

    def __call__(self) -> str | None:
        with self._lock:
            if time.monotonic() - self._read_at >= TOKEN_REREAD_S:
                try:
                    self._token = self._path.read_text().strip()
                except OSError as e:
                    raise RestError(0, f"cannot read the token {self._path}: {e.strerror or e}") from None
                self._read_at = time.monotonic()
            return self._token


def _path(template: str, params: Mapping[str, str] | None) -> str:
    """A path from its template ("/api/v1/namespaces/{namespace}/pods/{name}":
    callers write the API's paths as its reference does, which the RBAC tests
    read) and the values, each quoted as one segment."""
    return template.format_map({k: quote(v, safe=":") for k, v in (params or {}).items()})


MAX_LINE = 65536  # a status or header line of an answer
MAX_HEADERS = 100
MAX_ANSWER = 256 << 20  # bytes of one whole answer


class _Kept:
    """HTTP/1.1 calls whose answer is read whole, over kept connections.
    Through urllib3 (http.client, the email package for every answer's
    head) a call cost more CPU than the work it asked for, and a bind makes
    two. Like urllib3 without retries: a kept connection the server closed
    meanwhile is found before it is used (readable while idle) and not
    used; a call that fails is not sent again. Thread-safe."""

    def __init__(self, url: str, tls: ssl.SSLContext | None, size: int) -> None:
        parts = urlsplit(url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._https else 80)
        self._netloc = parts.netloc
        self._tls = tls if self._https else None
        if self._https and self._tls is None:
            self._tls = ssl.create_default_context()
        self._size = size
        self._lock = threading.Lock()
        self._idle: list[tuple[socket.socket, BinaryIO]] = []
        self._closed = False

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self._closed = True
        for conn in idle:
            _shut(conn)

    def _take(self, timeout: float) -> tuple[socket.socket, BinaryIO]:
        with self._lock:
            while self._idle:
                conn = self._idle.pop()
                if not _dropped(conn[0]):
                    conn[0].settimeout(timeout)
                    return conn
                _shut(conn)
        sock = socket.create_connection((self._host, self._port), timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.wrap_socket(sock, server_hostname=self._host)
        except BaseException:
            sock.close()
            raise
        return sock, sock.makefile("rb")

    def _give(self, conn: tuple[socket.socket, BinaryIO]) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._size:
                self._idle.append(conn)
                return
        _shut(conn)

    def request(
        self, method: str, target: str, headers: Mapping[str, str], body: bytes | None, timeout: float
    ) -> tuple[int, str, bytes]:
        """(status, reason, body); OSError when the server cannot be reached
        or answers what is not HTTP/1.x."""
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self._netloc}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")
        conn = self._take(timeout)
        try:
            conn[0].sendall(data)
            status, reason, answer, keep = _answer(conn[1], method)
        except BaseException:
            _shut(conn)
            raise
        if keep:
            self._give(conn)
        else:
            _shut(conn)
        return status, reason, answer


def _shut(conn: tuple[socket.socket, BinaryIO]) -> None:
    for part in (conn[1], conn[0]):
        try:
            part.close()
        except OSError:
            pass


def _dropped(sock: socket.socket) -> bool:
    """An idle connection with something to read: the server closed it (or
    sent what no request asked for)."""
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return bool(poll.poll(0))


def _line(rfile: BinaryIO) -> bytes:
    line = rfile.readline(MAX_LINE + 1)
    if len(line) > MAX_LINE:
        raise ConnectionError("the API server sent a line longer than 64 KiB")
    if not line:
        raise ConnectionError("the API server closed the connection")
    return line


def _answer(rfile: BinaryIO, method: str) -> tuple[int, str, bytes, bool]:
    """(status, reason, body, whether the connection can be kept) of one
    answer; informational (1xx) answers before it are skipped."""
    while True:
        words = _line(rfile).split(None, 2)
        if len(words) < 2 or not words[0].startswith(b"HTTP/1.") or not words[1].isdigit():
            raise ConnectionError(f"the API server's answer is not HTTP/1.x: {b' '.join(words)[:100]!r}")
        status, reason = int(words[1]), words[2].strip().decode("latin-1") if len(words) > 2 else ""
        keep = words[0] == b"HTTP/1.1"
        length: int | None = None
        chunked = False
        for _ in range(MAX_HEADERS + 1):
            line = _line(rfile)
            if line in (b"\r\n", b"\n"):
                break
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip()
            if name == b"content-length":
                if not value.isdigit():
                    raise ConnectionError(f"the API server sent Content-Length {value[:40]!r}")
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = value.lower() != b"identity"
            elif name == b"connection":
                tokens = {t.strip() for t in value.lower().split(b",")}
                keep = b"close" not in tokens and (keep or b"keep-alive" in tokens)
        else:
            raise ConnectionError(f"the API server sent more than {MAX_HEADERS} header lines")
        if 100 <= status < 200:
            continue
        if method == "HEAD" or status in (204, 304):
            return status, reason, b"", keep
        if chunked:
            return status, reason, _chunks(rfile), keep
        if length is None:  # to the end of the connection
            body = rfile.read(MAX_ANSWER + 1)
            if len(body) > MAX_ANSWER:
                raise ConnectionError(f"the API server's answer is over {MAX_ANSWER} bytes")
            return status, reason, body, False
        if length > MAX_ANSWER:
            raise ConnectionError(f"the API server's answer is {length} bytes, over {MAX_ANSWER}")
        body = rfile.read(length)
        if len(body) != length:
            raise ConnectionError("the API server closed the connection inside an answer")
        return status, reason, body, keep


def _chunks(rfile: BinaryIO) -> bytes:
    parts: list[bytes] = []
    total = 0
    while True:
        size_text = _line(rfile).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise ConnectionError(f"the API server sent a bad chunk size {size_text[:40]!r}") from None
        if size == 0:
            for _ in range(MAX_HEADERS + 1):  # trailers, then the empty line
                if _line(rfile) in (b"\r\n", b"\n"):
                    return b"".join(parts)
            raise ConnectionError("the API server sent too many trailer lines")
        total += size
        if size < 0 or total > MAX_ANSWER:
            raise ConnectionError(f"the API server's answer is over {MAX_ANSWER} bytes")
        chunk = rfile.read(size)
        if len(chunk) != size or _line(rfile) not in (b"\r\n", b"\n"):
            raise ConnectionError("the API server closed the connection inside a chunk")
        parts.append(chunk)


class RestClient:
    def __init__(self, server: Server, timeout: float, connections: int = 4) -> None:
        self._server = server
        self._timeout = timeout
        self._pool = urllib3.PoolManager(maxsize=connections, ssl_context=server.tls, retries=False)
        self._kept = _Kept(server.url, server.tls, connections)

    def close(self) -> None:
        self._pool.clear()
        self._kept.close()

    def call(
        self,
        method: str,
        path: str,
        params: Mapping[str, str] | None = None,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str = JSON,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """The JSON object the API server answers; RestError otherwise."""
        status, data = self._whole(method, _path(path, params), query, body, content_type, timeout)
        try:
            value = json.loads(data)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise RestError(status, "the API server's answer is not a JSON object")
        return value

    def send(self, method: str, path: str, params: Mapping[str, str], body: Any) -> None:
        """A call whose answer is not needed (a Binding's is a Status, or nothing)."""
        self._whole(method, _path(path, params), None, body, JSON, None)

    def fetch(self, path: str, params: Mapping[str, str]) -> bytes:
        """The body of a GET, whatever it is (a service's answer, through the API server's proxy)."""
        return self._whole("GET", _path(path, params), None, None, JSON, None)[1]

    def _headers(self, body: Any, content_type: str) -> tuple[dict[str, str], bytes | None]:
        headers = {"Accept": JSON}
        token = self._server.token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body).encode()
        return headers, data

    def _whole(
        self,
        method: str,
        path: str,
        query: Mapping[str, str] | None,
        body: Any,
        content_type: str,
        timeout: float | None,
    ) -> tuple[int, bytes]:
        """(status, body) of a 2xx answer read whole; RestError otherwise."""
        headers, data = self._headers(body, content_type)
        target = path + (f"?{urlencode(query)}" if query else "")
        try:
            status, reason, answer = self._kept.request(
                method, target, headers, data, self._timeout if timeout is None else timeout
            )
        except OSError as e:  # TLS errors and timeouts are OSErrors too
            raise RestError(0, f"the API server cannot be reached ({e})") from None
        if not 200 <= status <= 299:
            raise RestError(status, _message(answer) or reason)
        return status, answer

    def watch(self, path: str, query: Mapping[str, str], timeout: float) -> Iterator[dict[str, Any]]:
        """The events of a watch (`watch=1` is added), one JSON object a line,
        until the API server ends it or `timeout` seconds pass without a byte."""
        answer = self._request("GET", path, {**query, "watch": "1"}, None, JSON, timeout, stream=True)
        try:
            pending = b""
            for chunk in answer.stream(65536, decode_content=True):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield json.loads(line)
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise RestError(0, f"the watch broke off: {e}") from None
        finally:
            answer.release_conn()

    def _request(
        self,
        method: str,
        path: str,
        query: Mapping[str, str] | None,
        body: Any,
        content_type: str,
        timeout: float | None,
        stream: bool,
    ) -> urllib3.BaseHTTPResponse:
        headers, data = self._headers(body, content_type)
        url = self._server.url + path + (f"?{urlencode(query)}" if query else "")
        seconds = self._timeout if timeout is None else timeout
        try:
            answer = self._pool.request(
                method, url, body=data, headers=headers, timeout=seconds, preload_content=not stream
            )
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise RestError(0, f"the API server cannot be reached ({e})") from None
        if not 200 <= answer.status <= 299:
            raw = answer.read() if stream else answer.data
            if stream:
                answer.release_conn()
            raise RestError(answer.status, _message(raw) or answer.reason or "")
        return answer


def _message(data: bytes | None) -> str:
    """The message of a Status the API server sent, else ""."""
    try:
        status = json.loads(data or b"")
    except ValueError:
        return ""
    return str(status.get("message", "")) if isinstance(status, dict) else ""
