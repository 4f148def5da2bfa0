"""A real older distribution for the package tests: Debian 11 "bullseye"
(glibc 2.31, dpkg 1.20, runc 1.0), made once by `debootstrap
--variant=minbase` from Debian's registry and cached outside the clone by
release and recipe ($XDG_CACHE_HOME or ~/.cache, then
cgpu/roots/<release>-minbase-r<N>/).

Each test gets its own copy-on-write overlay of the cached root, mounted in
a mount namespace of its own (held by a `sleep` in `unshare -m`), with
/proc, /sys, /dev and a fresh /run and /tmp: commands run there through
nsenter and chroot. When the holder and what runs inside end, the
namespace goes, and every mount made in it (the overlay, cgpud's region
tmpfs) with it; the cache is never written.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

RELEASE = "bullseye"
MIRROR = "http://deb.debian.org/debian"
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class OlderRootError(RuntimeError):
    pass


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "cgpu" / "roots"


@dataclass(frozen=True)
class Recipe:
    """What debootstrap makes: `name` and `revision` key the cache (raise
    the revision when `include` changes)."""

    release: str
    include: tuple[str, ...]
    name: str
    revision: int


# runc: the root's own, for a container started through the root's cgpu-runtime.
BULLSEYE = Recipe(RELEASE, ("runc",), "minbase", 1)


def cached_root(recipe: Recipe = BULLSEYE) -> Path:
    """The debootstrapped root, made first if it is not in the cache."""
    cache = cache_root()
    release = recipe.release
    root = cache / f"{release}-{recipe.name}-r{recipe.revision}"
    if (root / ".complete").is_file():
        return root / "fs"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (root / ".complete").is_file():
            return root / "fs"
        staging = Path(tempfile.mkdtemp(prefix=f".{release}-", dir=cache))
        try:
            proc = subprocess.run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join(recipe.include)}",
                    release,
                    str(staging / "fs"),
                    MIRROR,
                ],
                capture_output=True,
                text=True,
                timeout=1800,
            )
            if proc.returncode != 0:
                raise OlderRootError(f"debootstrap {release} failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
            # The packages' files stay; apt's downloads do not.
            shutil.rmtree(staging / "fs" / "var" / "cache" / "apt" / "archives", ignore_errors=True)
            (staging / ".complete").touch()
            if root.exists():
                shutil.rmtree(root)
            staging.rename(root)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return root / "fs"


@dataclass(frozen=True)
class OlderRoot:
    """A private, writable view of the cached root. `path` is where it is
    mounted inside the holder's namespace; `host_path(p)` reaches a path of
    the root from this process (through /proc/<holder>/root)."""

    holder: subprocess.Popen[bytes]
    path: Path

    def host_path(self, inside: str | Path) -> Path:
        return Path(f"/proc/{self.holder.pid}/root") / self.path.relative_to("/") / Path(inside).relative_to("/")

    def command(self, argv: Sequence[str | Path]) -> list[str]:
        """argv run inside the root."""
        return self.beside(["chroot", str(self.path), *map(str, argv)])

    def beside(self, argv: Sequence[str | Path]) -> list[str]:
        """argv, one of this machine's programs, run in the holder's mount
        namespace, where the root is mounted at `path`."""
        return ["nsenter", "-t", str(self.holder.pid), "-m", "--", *map(str, argv)]

    def environment(self, **extra: str) -> dict[str, str]:
        return {"PATH": PATH, "HOME": "/root", "LANG": "C.UTF-8", **extra}

    def run(
        self, *argv: str | Path, env: dict[str, str] | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(argv), env=env or self.environment(), capture_output=True, text=True, timeout=timeout
        )

    def copy_in(self, src: Path, inside: str) -> str:
        shutil.copy2(src, self.host_path(inside))
        return inside


def _in_holder(holder: subprocess.Popen[bytes], *argv: str) -> None:
    proc = subprocess.run(["nsenter", "-t", str(holder.pid), "-m", "--", *argv], capture_output=True, text=True)
    if proc.returncode != 0:
        raise OlderRootError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")


@contextmanager
def older_root(work: Path, recipe: Recipe = BULLSEYE, api_filesystems: bool = True) -> Iterator[OlderRoot]:
    """`api_filesystems`: /proc, /sys, /dev, /run and /tmp mounted for a
    chroot; off for a root that an init boots (it mounts its own)."""
    lower = cached_root(recipe)
    upper, scratch, merged = work / "upper", work / "overlay-work", work / "merged"
    for d in (upper, scratch, merged):
        d.mkdir(parents=True)
    holder = subprocess.Popen(["unshare", "-m", "--propagation", "private", "sleep", "infinity"])
    try:
        _wait_for_namespace(holder)
        _in_holder(
            holder,
            "mount",
            "-t",
            "overlay",
            "cgpu-older-root",
            "-o",
            f"lowerdir={lower},upperdir={upper},workdir={scratch}",
            str(merged),
        )
        for tmpfs in ("run", "tmp") if api_filesystems else ():
            _in_holder(
                holder,
                "mount",
                "-t",
                "tmpfs",
                "-o",
                "mode=1777" if tmpfs == "tmp" else "mode=755",
                tmpfs,
                str(merged / tmpfs),
            )
        if api_filesystems:
            _in_holder(holder, "mount", "-t", "proc", "proc", str(merged / "proc"))
            _in_holder(holder, "mount", "--rbind", "/sys", str(merged / "sys"))
            _in_holder(holder, "mount", "--rbind", "/dev", str(merged / "dev"))
        yield OlderRoot(holder, merged)
    finally:
        holder.kill()
        holder.wait()


def _wait_for_namespace(holder: subprocess.Popen[bytes]) -> None:
    """unshare has made its namespace once /proc/<pid>/ns/mnt differs from ours."""
    import time

    ours = os.readlink("/proc/self/ns/mnt")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if holder.poll() is not None:
            raise OlderRootError(f"unshare -m exited with {holder.returncode}")
        try:
            if os.readlink(f"/proc/{holder.pid}/ns/mnt") != ours:
                return
        except FileNotFoundError:
            pass
        time.sleep(0.01)
    raise OlderRootError("unshare -m did not make its mount namespace within 10 s")
