"""Build glue: the cffi scheduler extension plus every other C part
(csrc/build_native.py), so `pip install .` and `pip install -e .` need no
separate make step."""
from __future__ import annotations

import sys
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build

sys.path.insert(0, str(Path(__file__).resolve().parent / "csrc"))
import build_native  # noqa: E402


class BuildNative(Command):
    description = "build the simulated driver, relays and tools into cgpud/_native"
    user_options: list = []

    def initialize_options(self) -> None:
        self.build_lib = None
        self.editable_mode = False
        self._outputs: list[str] = []

    def finalize_options(self) -> None:
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _out_dir(self) -> Path:
        # Editable installs import cgpud from the source tree.
        root = Path(__file__).resolve().parent if self.editable_mode else Path(self.build_lib)
        return root / "cgpud" / "_native"

    def run(self) -> None:
        try:
            self._outputs = [str(p) for p in build_native.build_all(self._out_dir())]
        except build_native.NativeBuildError as e:
            raise SystemExit(f"error: {e}") from e

    def get_outputs(self) -> list[str]:
        return self._outputs

    def get_output_mapping(self) -> dict[str, str]:
        return {}

    def get_source_files(self) -> list[str]:
        return []


build.sub_commands.append(("build_native", None))

setup(
    cmdclass={"build_native": BuildNative},
    cffi_modules=["csrc/scheduler/build_scheduler.py:ffibuilder", "csrc/region/build_region.py:ffibuilder"],
)
