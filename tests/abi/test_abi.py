"""The ABI we implement is NVIDIA's: same values, layouts and prototypes as
the real cuda.h and nvml.h (of the default CUDA line's wheels, tests/harness/cudakit.py),
and exactly the exported symbols our X-macro lists name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "csrc"))
import build_native  # noqa: E402

from tests.harness import cudakit  # noqa: E402
from tests.harness.cc import compile_strict  # noqa: E402


@pytest.fixture(scope="module")
def cuda_include() -> Path:
    """NVIDIA's cuda.h, from the default line's wheels."""
    return cudakit.toolkit().header("cuda.h").parent


@pytest.fixture(scope="module")
def nvml_include() -> Path:
    """NVIDIA's nvml.h, from the newest line's wheels."""
    return cudakit.toolkit(cudakit.NVML).header("nvml.h").parent


def _probe(tmp_path: Path, *flags: str, source: str = "abi_probe.c") -> str:
    exe = tmp_path / f"{Path(source).stem}{len(flags)}"
    compile_strict(exe, *flags, f"-I{ROOT / 'csrc/include'}", str(ROOT / "tests/abi" / source))
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


def test_values_and_layouts_match_the_real_cuda_h(tmp_path, cuda_include):
    ours = _probe(tmp_path)
    real = _probe(tmp_path, "-DCGPU_USE_REAL_CUDA_H", f"-I{cuda_include}")
    assert ours.count("\n") > 100
    assert ours == real


@pytest.mark.parametrize("output", ["sim/libcuda.so.1", "bin/cgpu-burn", "lib/libcgpu.so"])
def test_driver_code_compiles_against_the_real_cuda_h(tmp_path, output, cuda_include):
    # A prototype that drifted from NVIDIA's is a "conflicting types" error.
    target = next(t for t in build_native.TARGETS if t.output == output)
    assert build_native.compile_target(target, tmp_path, build_native.real_cuda_h(cuda_include)).exists()


def test_nvml_values_and_layouts_match_the_real_nvml_h(tmp_path, nvml_include):
    ours = _probe(tmp_path, source="nvml_probe.c")
    real = _probe(tmp_path, "-DCGPU_USE_REAL_NVML_H", f"-I{nvml_include}", source="nvml_probe.c")
    assert ours.count("\n") > 150
    assert ours == real


@pytest.mark.parametrize("output", ["sim/libnvidia-ml.so.1", "lib/libcgpu.so"])
def test_nvml_code_compiles_against_the_real_nvml_h(tmp_path, output, nvml_include):
    # A prototype that drifted from NVIDIA's is a "conflicting types" error.
    target = next(t for t in build_native.TARGETS if t.output == output)
    assert build_native.compile_target(target, tmp_path, build_native.real_nvml_h(nvml_include)).exists()


def _exports(lib: Path) -> list[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], check=True, capture_output=True, text=True).stdout
    return sorted(line.split()[-1] for line in out.splitlines() if line.split()[1] in "TW")


@pytest.mark.parametrize(
    ("lib", "def_file", "macro"),
    [
        ("sim/libcuda.so.1", "include/cgpu/cuda_functions.def", "CU_FN"),
        ("sim/libnvidia-ml.so.1", "include/cgpu/nvml_functions.def", "NVML_FN"),
        ("lib/libcgpu.so", "intercept/hooks.def", "HOOK"),
    ],
)
def test_libraries_export_exactly_their_lists(native, lib, def_file, macro):
    target = next(t for t in build_native.TARGETS if t.output == lib)
    assert (def_file, macro) == target.exports
    assert build_native.exported_symbols(def_file, macro)
    assert _exports(native / lib) == build_native.target_exports(target)


def _nvml_generator():
    sys.path.insert(0, str(ROOT / "csrc" / "simgpu"))
    import gen_nvml_unmodelled

    return gen_nvml_unmodelled


def test_simulated_nvml_exports_every_function_of_the_real_nvml_h(native, nvml_include):
    # Newest versions and the legacy names alike: what a real libnvidia-ml.so.1 exports.
    gen = _nvml_generator()
    declared = {name for name, _ in gen.header_functions(gen.preprocess(nvml_include / "nvml.h"))}
    assert len(declared) > 400 and {"nvmlInit", "nvmlInit_v2", "nvmlDeviceGetCount"} <= declared
    assert set(_exports(native / "sim/libnvidia-ml.so.1")) == declared


def test_generated_nvml_stub_list_is_current(nvml_include):
    gen = _nvml_generator()
    assert gen.UNMODELLED_DEF.read_text() == gen.generate(nvml_include / "nvml.h"), (
        f"run: .venv/bin/python csrc/simgpu/gen_nvml_unmodelled.py {nvml_include / 'nvml.h'}"
    )


def test_every_nvml_stub_answers_not_supported(native):
    # Stubs read no arguments, so each can be called bare; none may need init.
    stubs = build_native.exported_symbols("simgpu/nvml_unmodelled.def", "NVML_STUB")
    script = (
        "import ctypes, sys\n"
        f"lib = ctypes.CDLL({str(native / 'sim/libnvidia-ml.so.1')!r})\n"
        "print(sorted({getattr(lib, n)() for n in sys.argv[1:]}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script, *stubs], check=True, capture_output=True, text=True).stdout
    assert len(stubs) > 300
    assert out.strip() == "[3]"  # NVML_ERROR_NOT_SUPPORTED


def _cuda_generator():
    sys.path.insert(0, str(ROOT / "csrc" / "simgpu"))
    import gen_cuda_exports

    return gen_cuda_exports


def test_simulated_driver_exports_every_function_of_the_real_cuda_h(native, cuda_include):
    # Every variant a real libcuda.so.1 exports (_v2, _ptds, the 32-bit v1 forms), nothing else.
    declared = set(_cuda_generator().declarations(cuda_include))
    assert len(declared) > 600 and {"cuMemAlloc", "cuMemAlloc_v2", "cuMemcpy_ptds", "cuGetExportTable"} <= declared
    assert set(_exports(native / "sim/libcuda.so.1")) == declared


def test_generated_cuda_stub_list_is_current(cuda_include):
    gen = _cuda_generator()
    made = gen.render(cuda_include, gen.MODELLED_DEF.read_text())
    assert gen.UNMODELLED_DEF.read_text() == made, (
        f"run: .venv/bin/python csrc/simgpu/gen_cuda_exports.py {cuda_include}"
    )


def test_cuda_stub_prototypes_match_the_real_cuda_h(tmp_path, cuda_include):
    # The stubs are defined without parameters; the list's prototypes, kept
    # for readers and checks, must still be NVIDIA's ("conflicting types").
    src = tmp_path / "stubs.c"
    src.write_text(
        "#define __CUDA_API_VERSION_INTERNAL 1\n#include <cuda.h>\n"
        "#define CU_STUB(symbol, params) CUresult CUDAAPI symbol params;\n#define CU_PROC(symbol, base, since, kind)\n"
        f'#include "{ROOT / "csrc/simgpu/cuda_unmodelled.def"}"\n'
    )
    subprocess.run(
        ["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-fsyntax-only", f"-I{cuda_include}", str(src)], check=True
    )
