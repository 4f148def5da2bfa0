"""The ABI we implement is NVIDIA's: same values, layouts and prototypes as
the real cuda.h (where the CUDA toolkit is installed) and the real nvml.h
(from the nvidia-nvml-dev wheel, a test dependency), and exactly the
exported symbols our X-macro lists name."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "csrc"))
import build_native  # noqa: E402

needs_real_cuda_h = pytest.mark.skipif(
    not (build_native.REAL_CUDA_INCLUDE / "cuda.h").exists(),
    reason="NVIDIA's cuda.h is not installed (CI machines have it at /usr/local/cuda)",
)




def _real_nvml_include() -> Path | None:
    """The directory of NVIDIA's nvml.h in the installed nvidia-nvml-dev wheel
    (nvidia/<cuda major>/include), wherever pip put it."""
    spec = importlib.util.find_spec("nvidia")
    for base in spec.submodule_search_locations or () if spec else ():
        for inc in sorted(Path(base).glob("*/include")):
            if (inc / "nvml.h").is_file():
                return inc
    return None


REAL_NVML_INCLUDE = _real_nvml_include()
needs_real_nvml_h = pytest.mark.skipif(
    REAL_NVML_INCLUDE is None,
    reason="NVIDIA's nvml.h is not installed (the nvidia-nvml-dev wheel of the test extra ships it)",
)


def _probe(tmp_path: Path, *flags: str, source: str = "abi_probe.c") -> str:
    exe = tmp_path / f"{Path(source).stem}{len(flags)}"
    subprocess.run(
        ["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", *flags, f"-I{ROOT / 'csrc/include'}",
         str(ROOT / "tests/abi" / source), "-o", str(exe)],
        check=True,
    )
    return subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout


@needs_real_cuda_h
def test_values_and_layouts_match_the_real_cuda_h(tmp_path):
    ours = _probe(tmp_path)
    real = _probe(tmp_path, "-DCGPU_USE_REAL_CUDA_H", f"-I{build_native.REAL_CUDA_INCLUDE}")
    assert ours.count("\n") > 100
    assert ours == real


@needs_real_cuda_h
@pytest.mark.parametrize("output", ["sim/libcuda.so.1", "bin/cgpu-burn", "lib/libcgpu.so"])
def test_driver_code_compiles_against_the_real_cuda_h(tmp_path, output):
    # A prototype that drifted from NVIDIA's is a "conflicting types" error.
    target = next(t for t in build_native.TARGETS if t.output == output)
    assert build_native.compile_target(target, tmp_path, build_native.REAL_CUDA_H).exists()


@needs_real_nvml_h
def test_nvml_values_and_layouts_match_the_real_nvml_h(tmp_path):
    ours = _probe(tmp_path, source="nvml_probe.c")
    real = _probe(tmp_path, "-DCGPU_USE_REAL_NVML_H", f"-I{REAL_NVML_INCLUDE}", source="nvml_probe.c")
    assert ours.count("\n") > 150
    assert ours == real


@needs_real_nvml_h
@pytest.mark.parametrize("output", ["sim/libnvidia-ml.so.1", "lib/libcgpu.so"])
def test_nvml_code_compiles_against_the_real_nvml_h(tmp_path, output):
    # A prototype that drifted from NVIDIA's is a "conflicting types" error.
    variant = build_native.Variant("real-nvml-h", ("-O2",), (), ("CGPU_USE_REAL_NVML_H",), (str(REAL_NVML_INCLUDE),))
    target = next(t for t in build_native.TARGETS if t.output == output)
    assert build_native.compile_target(target, tmp_path, variant).exists()


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


@needs_real_nvml_h
def test_simulated_nvml_exports_every_function_of_the_real_nvml_h(native):
    # Newest versions and the legacy names alike: what a real libnvidia-ml.so.1 exports.
    gen = _nvml_generator()
    declared = {name for name, _ in gen.header_functions(gen.preprocess(REAL_NVML_INCLUDE / "nvml.h"))}
    assert len(declared) > 400 and {"nvmlInit", "nvmlInit_v2", "nvmlDeviceGetCount"} <= declared
    assert set(_exports(native / "sim/libnvidia-ml.so.1")) == declared


@needs_real_nvml_h
def test_generated_nvml_stub_list_is_current():
    gen = _nvml_generator()
    assert gen.UNMODELLED_DEF.read_text() == gen.generate(REAL_NVML_INCLUDE / "nvml.h"), (
        "run: .venv/bin/python csrc/simgpu/gen_nvml_unmodelled.py"
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


@needs_real_cuda_h
def test_simulated_driver_exports_every_function_of_the_real_cuda_h(native):
    # Every variant a real libcuda.so.1 exports (_v2, _ptds, the 32-bit v1 forms), nothing else.
    declared = set(_cuda_generator().declarations(build_native.REAL_CUDA_INCLUDE))
    assert len(declared) > 600 and {"cuMemAlloc", "cuMemAlloc_v2", "cuMemcpy_ptds", "cuGetExportTable"} <= declared
    assert set(_exports(native / "sim/libcuda.so.1")) == declared


@needs_real_cuda_h
def test_generated_cuda_stub_list_is_current():
    gen = _cuda_generator()
    made = gen.render(build_native.REAL_CUDA_INCLUDE, gen.MODELLED_DEF.read_text())
    assert gen.UNMODELLED_DEF.read_text() == made, "run: .venv/bin/python csrc/simgpu/gen_cuda_exports.py"


@needs_real_cuda_h
def test_cuda_stub_prototypes_match_the_real_cuda_h(tmp_path):
    # The stubs are defined without parameters; the list's prototypes, kept
    # for readers and checks, must still be NVIDIA's ("conflicting types").
    src = tmp_path / "stubs.c"
    src.write_text(
        "#define __CUDA_API_VERSION_INTERNAL 1\n#include <cuda.h>\n"
        "#define CU_STUB(symbol, params) CUresult CUDAAPI symbol params;\n#define CU_PROC(symbol, base, since, kind)\n"
        f'#include "{ROOT / "csrc/simgpu/cuda_unmodelled.def"}"\n'
    )
    subprocess.run(["cc", "-std=c11", "-Wall", "-Wextra", "-Werror", "-fsyntax-only",
                    f"-I{build_native.REAL_CUDA_INCLUDE}", str(src)], check=True)
