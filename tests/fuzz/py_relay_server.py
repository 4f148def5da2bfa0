"""atheris target: cgpud's relay server from the wire in (cgpud/containers/relay.py
reading a request off a real socket, handle() dispatching it, and the
lifecycle it reaches: the container key, the bundle's config.json, the OCI
state JSON of the hooks), over a real InstanceService on SQLite in a
temporary directory.

Input: the request bytes exactly as a relay would send them. "/BUNDLES/"
stands for the directory of the bundles made here (gpu, plain, claim,
core) and "@DEVICE" for the id of an instance reserved as a device, which
the claim bundle mounts: so the fuzzer reaches a real prepare, bind and
poststop. An input starting "@SPEC" sends the gpu bundle's config.json as a
descriptor with the rest, as the shim's `prepare ... spec-fd` does.

Every refusal must be a CgpuError (one clear line to the relay); anything
else escaping is a bug the relay could only answer with "cgpud failed on
this request". After each input, instances it made are released and the
bundles rewritten, so every input meets the same state."""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
import threading
from pathlib import Path

import atheris

with atheris.instrument_imports(include=["cgpud.containers"]):
    from cgpud.containers import relay
    from cgpud.containers.edits import RuntimeFiles
    from cgpud.containers.lifecycle import ContainerLifecycle

from cgpud.node.model import GIB, GpuCapacity, InstanceState, NodePolicy, Owner, OwnerKind, Request
from cgpud.node.service import InstanceService
from cgpud.node.store import Store
from cgpud.errors import CgpuError

GPUS = (GpuCapacity(0, "GPU-aaaa", 16 * GIB), GpuCapacity(1, "GPU-bbbb", 16 * GIB))


class Harness:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.service = InstanceService(
            Store(root / "db" / "cgpud.db"), GPUS, NodePolicy(), root / "regions", "580.65.06", "boot-1"
        )
        files = RuntimeFiles(
            root / "runtime" / "libcgpu.so",
            root / "runtime" / "ld.so.preload",
            root / "runtime" / "cgpu-hook",
            root / "relay.sock",
        )
        self.lifecycle = ContainerLifecycle(self.service, files, trust_env=True)
        self.device = self.service.create(Request(Owner(OwnerKind.DEVICE, "fuzz-device"), 2 * GIB))
        self.bundles = root / "bundles"
        self.reset()

    def configs(self) -> dict[str, dict]:
        process = {"args": ["sh"], "env": ["PATH=/bin"]}
        return {
            "plain": {"ociVersion": "1.0.2", "process": process, "root": {"path": "rootfs"}},
            "gpu": {
                "ociVersion": "1.0.2",
                "root": {"path": "rootfs"},
                "process": {**process, "env": ["PATH=/bin", "ALIYUN_COM_GPU_MEM_CONTAINER=2"]},
            },
            "core": {
                "ociVersion": "1.0.2",
                "root": {"path": "rootfs"},
                "process": {**process, "env": ["ALIYUN_COM_GPU_MEM_CONTAINER=1", "ALIYUN_COM_GPU_CORE_PERCENTAGE=30"]},
            },
            "claim": {
                "ociVersion": "1.0.2",
                "process": process,
                "root": {"path": "rootfs"},
                "mounts": [
                    {
                        "destination": "/run/cgpu",
                        "type": "bind",
                        "options": ["rbind", "ro"],
                        "source": str(self.service.region_dir(self.device.id)),
                    }
                ],
            },
        }

    def reset(self) -> None:
        for name, spec in self.configs().items():
            (self.bundles / name / "rootfs").mkdir(parents=True, exist_ok=True)
            (self.bundles / name / "config.json").write_text(json.dumps(spec))

    def tidy(self) -> None:
        """Back to the state every input starts from."""
        changed = False
        for inst in self.service.list():
            if inst.id != self.device.id:
                self.service.release(inst.id)
                changed = True
        device = self.service.get(self.device.id)
        if device.owner.kind is not OwnerKind.DEVICE or not device.active:
            raise AssertionError("a relay request changed the reserved device instance's owner or ended it")
        if device.state is InstanceState.BOUND:
            self.service.unbind(device.id)
        if changed or any(b"cgpu-hook" in (self.bundles / n / "config.json").read_bytes() for n in ("claim",)):
            self.reset()

    def one(self, data: bytes) -> None:
        a, b = socket.socketpair()
        fds: list[int] = []
        if data.startswith(b"@SPEC") and len(data) > 5:  # the gpu bundle's config.json rides on the first byte
            spec = os.open(self.bundles / "gpu" / "config.json", os.O_RDONLY | os.O_CLOEXEC)
            try:
                socket.send_fds(a, [data[5:6]], [spec])
            finally:
                os.close(spec)
            data = data[6:]
        writer = threading.Thread(target=send, args=(a, data))
        try:
            if len(data) <= 32768:  # fits the socket buffer: no reader needed yet
                send(a, data)
            else:
                writer.start()
            try:
                words, body = relay._read_request(b, fds)
                words = [w.replace("@DEVICE", self.device.id) for w in words]
                body = body.replace(b"/BUNDLES/", str(self.bundles).encode() + b"/")
                text = relay.handle(self.lifecycle, words, body, fds=tuple(fds))
                if not isinstance(text, str) or "\n" in text:
                    raise AssertionError(f"answer text {text!r} is not one line")
            except CgpuError as e:
                if not str(e):
                    raise AssertionError("a refusal without a message") from e
        finally:
            for fd in fds:
                os.close(fd)
            b.close()  # a writer still sending gets EPIPE
            if writer.is_alive():
                writer.join()
            a.close()
            self.tidy()


def send(conn: socket.socket, data: bytes) -> None:
    try:
        conn.sendall(data)
        conn.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the server stopped reading (a request over RELAY_MAX_REQUEST)


def main() -> None:
    harness = Harness(Path(tempfile.mkdtemp(prefix="cgpu-fuzz-relay-")))
    atheris.Setup(sys.argv, harness.one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
