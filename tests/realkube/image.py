"""Container images for the real cluster, made without a registry or a
builder: a directory becomes a one-layer OCI image archive that
`ctr images import` loads into containerd, as an image pulled from a
registry would be. Pods name it with `imagePullPolicy: Never`."""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import tarfile
from pathlib import Path

# The sandbox's process: waits for a signal and exits on it, as
# registry.k8s.io/pause does (a PID 1 with no handler ignores SIGTERM).
PAUSE_C = r"""
#include <signal.h>
#include <unistd.h>
static void stop(int sig) { (void)sig; _exit(0); }
int main(void) {
    signal(SIGINT, stop);
    signal(SIGTERM, stop);
    for (;;) pause();
}
"""


def _blob(out: tarfile.TarFile, data: bytes) -> tuple[str, int]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest.removeprefix('sha256:')}")
    info.size = len(data)
    out.addfile(info, io.BytesIO(data))
    return digest, len(data)


def _layer(root: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as layer:
        for path in sorted(root.rglob("*")):
            info = layer.gettarinfo(str(path), arcname=str(path.relative_to(root)))
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if info.isreg():
                with open(path, "rb") as f:
                    layer.addfile(info, f)
            else:
                layer.addfile(info)
    return buffer.getvalue()


def write_archive(root: Path, name: str, archive: Path, entrypoint: list[str] | None = None) -> Path:
    """An OCI image archive of `root` named `name` (registry/repo:tag)."""
    layer = _layer(root)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
            **({"Entrypoint": entrypoint} if entrypoint else {}),
        },
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer).hexdigest()]},
    }
    with tarfile.open(archive, "w") as out:
        layer_digest, layer_size = _blob(out, layer)
        config_digest, config_size = _blob(out, json.dumps(config).encode())
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": config_digest,
                "size": config_size,
            },
            "layers": [
                {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": layer_size}
            ],
        }
        manifest_digest, manifest_size = _blob(out, json.dumps(manifest).encode())
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": manifest_digest,
                    "size": manifest_size,
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name},
                }
            ],
        }
        for entry, data in (
            ("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'),
            ("index.json", json.dumps(index).encode()),
        ):
            info = tarfile.TarInfo(entry)
            info.size = len(data)
            out.addfile(info, io.BytesIO(data))
    return archive


def pause_root(where: Path) -> Path:
    """A root holding only a static pause binary."""
    (where / "bin").mkdir(parents=True)
    source = where.parent / "pause.c"
    source.write_text(PAUSE_C)
    subprocess.run(
        ["cc", "-static", "-O2", "-o", str(where / "bin" / "pause"), str(source)], check=True, capture_output=True
    )
    return where
