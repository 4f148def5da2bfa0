"""Build glue: the cffi scheduler extension plus every other C part
(csrc/build_native.py) and the gRPC code generated from proto/ and third_party/proto/, so
`pip install .` and `pip install -e .` need no separate make step."""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import ClassVar

from setuptools import Command, setup
from setuptools.command.build import build

sys.path.insert(0, str(Path(__file__).resolve().parent / "csrc"))
import build_native


ROOT = Path(__file__).resolve().parent


class GeneratedFiles(Command):
    """A build step that writes files into the package: into the build
    directory, or into the source tree for editable installs (which import
    cgpud from there)."""

    user_options: ClassVar[list[tuple[str, str | None, str]]] = []
    package_dir: tuple[str, ...] = ()

    def initialize_options(self) -> None:
        self.build_lib = None
        self.editable_mode = False
        self._outputs: list[str] = []

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _out_dir(self) -> Path:
        root = ROOT if self.editable_mode else Path(self.build_lib)
        return root.joinpath(*self.package_dir)

    def get_outputs(self) -> list[str]:
        return self._outputs

    def get_output_mapping(self) -> dict[str, str]:
        return {}

    def get_source_files(self) -> list[str]:
        return []


class BuildNative(GeneratedFiles):
    description = "build the simulated driver, relays and tools into cgpud/_native"
    package_dir = ("cgpud", "_native")

    def run(self) -> None:
        try:
            self._outputs = [str(p) for p in build_native.build_all(self._out_dir())]
        except build_native.NativeBuildError as e:
            raise SystemExit(f"error: {e}") from e


# (import root, path below it): protoc names each module after the path.
PROTOS = (
    ("proto", "cgpu/v1/local.proto"),
    ("proto", "cgpu/v1/capacity.proto"),
    # The kubelet's APIs, which cgpud's device plugin serves and calls:
    # Kubernetes' shape, transcribed, hence third_party/.
    ("third_party/proto", "k8s/deviceplugin/v1beta1/api.proto"),
    ("third_party/proto", "k8s/podresources/v1/api.proto"),
)
PROTO_ROOTS = tuple(dict.fromkeys(root for root, _ in PROTOS))
# protoc names modules after the proto's path ("cgpu/v1/local.proto" ->
# cgpu.v1.local_pb2); they are shipped as cgpud.api.cgpu.v1.local_pb2 (and
# cgpud.api.k8s.deviceplugin.v1beta1.api_pb2, ...).
PROTO_PACKAGE_DIR = ("cgpud", "api")


class BuildProto(GeneratedFiles):
    """Generate cgpud/api/cgpu/v1/*_pb2{,_grpc}.py{,i} with grpc_tools.protoc.
    Generated code is never committed: it must match the protobuf and grpcio
    the package is installed with; pyproject.toml pins the generator."""

    description = "generate the gRPC Python modules from proto/"
    package_dir = PROTO_PACKAGE_DIR

    def run(self) -> None:
        try:
            from importlib.resources import files

            from grpc_tools import protoc
        except ImportError as e:
            raise SystemExit(
                f"error: generating the gRPC code needs grpcio-tools ({e}); it is in"
                " [build-system] requires, so this happens only with --no-build-isolation:"
                " pip install grpcio-tools"
            ) from e
        out_dir = self._out_dir()
        # Generate into a scratch directory and move finished files into place,
        # so a failed protoc run never leaves half a set of modules in the package.
        with tempfile.TemporaryDirectory(prefix="cgpu-protoc-") as tmp:
            args = [
                "grpc_tools.protoc",
                *(f"-I{ROOT / root}" for root in PROTO_ROOTS),
                f"-I{files('grpc_tools') / '_proto'}",  # well-known types
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                *(str(ROOT / root / p) for root, p in PROTOS),
            ]
            if protoc.main(args) != 0:
                raise SystemExit(f"error: grpc_tools.protoc failed: {' '.join(args[1:])}")
            outputs = []
            for src in sorted(Path(tmp).rglob("*_pb2*.py*")):
                rel = src.relative_to(tmp)
                if src.name.endswith("_grpc.py"):
                    _make_pb2_import_relative(src, ".".join(rel.parent.parts))
                dest = out_dir / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(src, dest)
                outputs.append(str(dest))
        self._outputs = outputs

    def get_source_files(self) -> list[str]:
        # setuptools wants these relative to setup.py, /-separated.
        return [f"{root}/{p}" for root, p in PROTOS]


def _make_pb2_import_relative(path: Path, package: str) -> None:
    """`from cgpu.v1 import local_pb2` -> `from . import local_pb2`: the
    generated package lives inside cgpud, and a relative import keeps it
    from depending on where that is (or on a top-level `cgpu` or `k8s`).
    `package` is the module's own dotted package ("cgpu.v1")."""
    absolute = re.compile(rf"^from {re.escape(package)} import (\w+_pb2) as ", re.MULTILINE)
    text, n = absolute.subn(r"from . import \1 as ", path.read_text())
    top = package.split(".")[0]
    if n == 0 or f"from {top}." in text or f"import {top}." in text:
        # protoc changed its output: fail the build rather than ship a module
        # that cannot be imported.
        raise SystemExit(f"error: unexpected import lines in generated {path.name}; update setup.py")
    path.write_text(text)


build.sub_commands.append(("build_native", None))
build.sub_commands.append(("build_proto", None))

setup(
    cmdclass={"build_native": BuildNative, "build_proto": BuildProto},
    cffi_modules=["csrc/scheduler/build_scheduler.py:ffibuilder", "csrc/region/build_region.py:ffibuilder"],
)
