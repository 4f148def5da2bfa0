"""The real Kubernetes parts the real-cluster tests run, built from the Go
module proxy once and cached outside the clone, by version and by the hash
of what builds them:

    ~/.cache/cgpu/kube/k8s-v1.37.2-containerd-v2.2.9-<hash>/bin/
        kube                      etcd, kube-apiserver, kube-controller-manager,
        etcd, kube-apiserver, …   kube-scheduler and kubelet in one binary (kube/main.go),
                                  the names links to it
        containerd, containerd-shim-runc-v2, ctr

    python -m tests.realkube.build     # build (or find) them, print the bin directory

k8s.io/kubernetes cannot be `go install`ed (its go.mod replaces its staging
modules with local paths); kube/go.mod requires it and points each staging
module at its published v0.x release, and pins everything in kube/go.sum.
etcd is the server release k8s.io/kubernetes itself requires."""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

KUBERNETES = "v1.37.2"  # kube/go.mod requires this; change both together
CONTAINERD = "v2.2.9"
RECIPE = 1  # raise it when a change to how build() builds should rebuild the cached binaries
KUBE_MODULE = Path(__file__).parent / "kube"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet")
CONTAINERD_COMMANDS = ("containerd", "containerd-shim-runc-v2", "ctr")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cgpu" / "kube"
BUILD_TIMEOUT = 3600.0  # seconds; the first build on 2 cores takes a good part of that


class BuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class KubeBinaries:
    bin: Path

    def __getitem__(self, name: str) -> Path:
        return self.bin / name


def _key() -> str:
    digest = hashlib.sha256(f"{RECIPE} {_version_flags()}".encode())
    for part in (KUBE_MODULE / "go.mod", KUBE_MODULE / "go.sum", KUBE_MODULE / "main.go"):
        digest.update(part.read_bytes())
    return f"k8s-{KUBERNETES}-containerd-{CONTAINERD}-{digest.hexdigest()[:12]}"


def _version_flags() -> str:
    """The version the components report (a module build leaves it unset,
    v0.0.0-master): the kubelet reports it on its Node, kubectl compares it."""
    major, minor = KUBERNETES.removeprefix("v").split(".")[:2]
    return " ".join(
        f"-X {package}.{name}={value}"
        for package in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version")
        for name, value in (
            ("gitVersion", KUBERNETES),
            ("gitMajor", major),
            ("gitMinor", minor),
            ("gitTreeState", "clean"),
        )
    )


def _go_env() -> dict[str, str]:
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
    if go is None:
        raise BuildError("the real-cluster tests build Kubernetes with Go (1.26 or newer): `go` is not on PATH")
    env = dict(os.environ)
    env["PATH"] = f"{Path(go).parent}:{env.get('PATH', '')}"
    # Both modules name Go 1.26; a machine's newer Go builds them as they are.
    env.setdefault("GOTOOLCHAIN", "local")
    env["CGO_ENABLED"] = "0"  # static binaries; containerd's cgo-only snapshotter (btrfs) is left out
    env["GOFLAGS"] = "-mod=readonly -trimpath -buildvcs=false"
    return env


def _go(env: dict[str, str], cwd: Path, *args: str) -> float:
    started = time.monotonic()
    done = subprocess.run(["go", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT)
    if done.returncode != 0:
        raise BuildError(f"go {' '.join(args)} failed in {cwd}:\n{done.stderr[-6000:]}")
    return time.monotonic() - started


def build(log=print) -> KubeBinaries:
    """The cached binaries, built first if they are not there (one builder at
    a time: others wait on the lock and then find them)."""
    target = CACHE / _key()
    done_mark = target / "built"
    if done_mark.exists():
        return KubeBinaries(target / "bin")
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done_mark.exists():
            return KubeBinaries(target / "bin")
        shutil.rmtree(target, ignore_errors=True)
        for stale in CACHE.glob("*.partial"):  # what an interrupted build left, under the same lock
            shutil.rmtree(stale, ignore_errors=True)
        work = target.with_name(target.name + ".partial")
        (work / "bin").mkdir(parents=True)
        env = _go_env()
        seconds = _go(
            env, KUBE_MODULE, "build", f"-ldflags=-s -w {_version_flags()}", "-o", str(work / "bin" / "kube"), "."
        )
        log(f"built etcd and Kubernetes {KUBERNETES} in {seconds:.0f} s")
        for name in COMPONENTS:
            (work / "bin" / name).symlink_to("kube")
        env_install = dict(env, GOBIN=str(work / "bin"), GOFLAGS="-trimpath -buildvcs=false")
        packages = [f"github.com/containerd/containerd/v2/cmd/{name}@{CONTAINERD}" for name in CONTAINERD_COMMANDS]
        seconds = _go(env_install, work, "install", "-ldflags=-s -w", *packages)
        log(f"built containerd {CONTAINERD} in {seconds:.0f} s")
        done_markers = work / "built"
        done_markers.write_text(f"{KUBERNETES} {CONTAINERD}\n")
        work.rename(target)
    return KubeBinaries(target / "bin")


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    try:
        binaries = build(log=lambda line: print(line, file=sys.stderr))
    except BuildError as e:
        print(f"tests.realkube.build: {e}", file=sys.stderr)
        return 1
    print(binaries.bin)
    return 0


if __name__ == "__main__":
    sys.exit(main())
