"""resolve.c tested the way libcgpu.so uses it: a preloaded library whose
exported dlsym/dlvsym hooks forward through cgpu_real_dlsym/cgpu_real_dlvsym
and answer RTLD_NEXT with cgpu_dlsym_next. The program (resolve/prog.c) runs
once without the preload, where every answer is glibc's, and once with it;
answers are compared across the runs as file:offset and, within the preloaded
run, with glibc's dlsym called directly from the same caller object."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
INTERCEPT = ROOT / "csrc" / "intercept"
SRC = Path(__file__).resolve().parent / "resolve"
CC = os.environ.get("CC", "cc")
FLAGS = ("-std=c11", "-Wall", "-Wextra", "-Werror", "-fPIC", "-g")
SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer")
# The test objects call dlsym(RTLD_NEXT) and must stay the caller: a sibling
# call would make glibc see their caller instead.
CALLER_CODE = ("-O0", "-fno-optimize-sibling-calls")


def compiler_file(name: str) -> str | None:
    out = subprocess.run([CC, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
    return out if os.path.isabs(out) and os.path.exists(out) else None


def compile_c(extra: tuple[str, ...], *args: object) -> None:
    cmd = [CC, *FLAGS, *extra, *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stderr}"


def build(out: Path, sanitized: bool) -> None:
    extra = SANITIZE if sanitized else ()
    compile_c(
        extra,
        "-O2",
        "-fvisibility=hidden",
        "-shared",
        f"-I{INTERCEPT}",
        INTERCEPT / "resolve.c",
        SRC / "preload_shim.c",
        "-o",
        out / "libpreloaded.so",
    )
    # -ldl puts libdl.so.2 in the process: a stub without dlsym on glibc >= 2.34,
    # the home of dlsym before; the libc search must cope with either.
    compile_c(
        extra + CALLER_CODE,
        "-shared",
        "-Wl,-soname,liba.so",
        "-Wl,--hash-style=gnu",
        SRC / "liba.c",
        "-ldl",
        "-o",
        out / "liba.so",
    )
    # Only DT_HASH in libb, so lookups there take the fallback path.
    compile_c(
        extra + CALLER_CODE,
        "-shared",
        "-Wl,-soname,libb.so",
        "-Wl,--hash-style=sysv",
        SRC / "libb.c",
        "-o",
        out / "libb.so",
    )
    compile_c(
        extra, "-shared", f"-Wl,--version-script={SRC / 'libother.map'}", SRC / "libother.c", "-o", out / "libother.so"
    )
    compile_c(extra + CALLER_CODE, SRC / "prog.c", f"-L{out}", "-la", "-lb", f"-Wl,-rpath,{out}", "-o", out / "prog")


@dataclass(frozen=True)
class Runs:
    dir: Path
    sanitized: bool
    plain: dict[str, str]  # without the preload: glibc's answers
    pre: dict[str, str]  # with libpreloaded.so
    other: dict[str, str]  # with libpreloaded.so and, after it, another dlsym interposer


def run(out: Path, preload: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    env["ASAN_OPTIONS"] = "detect_leaks=1"  # explicit: a leak would fail the run
    env["UBSAN_OPTIONS"] = "halt_on_error=1:print_stacktrace=1"
    proc = subprocess.run([str(out / "prog")], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"prog (LD_PRELOAD={preload}) exited {proc.returncode}:\n{proc.stderr}"
    return dict(line.split("=", 1) for line in proc.stdout.splitlines())


@pytest.fixture(scope="module", params=["plain", "sanitized"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    sanitized = request.param == "sanitized"
    asan = compiler_file("libasan.so")
    if sanitized and asan is None:
        pytest.skip(f"{CC} has no libasan.so")
    out = tmp_path_factory.mktemp(f"resolve-{request.param}")
    build(out, sanitized)
    # The ASan runtime must come first in the library list, before our preload.
    preload = ([asan] if sanitized else []) + [str(out / "libpreloaded.so")]
    return Runs(
        out, sanitized, run(out, preload[:-1]), run(out, preload), run(out, preload + [str(out / "libother.so")])
    )


def test_hook_serves_the_programs_dlsym_and_changes_no_answer(runs: Runs) -> None:
    assert runs.pre["preloaded"] == "1" and runs.plain["preloaded"] == "0"
    # Exactly one hook entry per call: the hook neither loops nor recurses.
    assert runs.pre["dlsym_delta"] == "1"
    assert runs.pre["dlvsym_delta"] == "1"
    assert runs.pre["hooked_default_which"] == runs.plain["default_which"]
    assert runs.pre["hooked_default_which"].startswith("liba.so:")
    assert runs.pre["hooked_libc_memcpy_2.2.5"].startswith("libc.so")
    # Every answer the program got through plain dlsym/dlvsym -- RTLD_DEFAULT,
    # handles, and RTLD_NEXT from liba, libb and the program -- is what glibc
    # alone gave it.
    common = {k: runs.pre[k] for k in runs.plain if k != "preloaded"}
    assert common == {k: v for k, v in runs.plain.items() if k != "preloaded"}


def test_real_dlsym_and_dlvsym_are_libcs(runs: Runs) -> None:
    assert runs.plain["libc_dlsym"].startswith("libc.so.6:")
    assert runs.pre["real_dlsym"] == runs.plain["libc_dlsym"]
    assert runs.plain["libc_dlvsym"].startswith("libc.so.6:")
    assert runs.pre["real_dlvsym"] == runs.plain["libc_dlvsym"]
    # ...and they work when called.
    assert runs.pre["real_dlsym_default_which"] == runs.plain["default_which"]
    assert runs.pre["real_dlvsym_libc_memcpy_2.2.5"] == runs.plain["a_next_memcpy_2.2.5"]


def test_real_dlsym_is_not_another_interposers(runs: Runs) -> None:
    # libother.so exports dlsym@@GLIBC_2.34 returning NULL; had it been taken
    # for libc's, every forwarded lookup below would come back null.
    assert runs.other["real_dlsym"] == runs.plain["libc_dlsym"]
    assert runs.other["real_dlvsym"] == runs.plain["libc_dlvsym"]
    assert runs.other["hooked_default_which"] == runs.plain["default_which"]
    assert runs.other["handle_b_which"] == runs.plain["handle_b_which"]


def test_dlsym_next_matches_glibcs_rtld_next(runs: Runs) -> None:
    # Sanity of the expectations: the cases are not all "not found".
    assert runs.plain["a_next_which"].startswith("libb.so:")
    assert runs.plain["main_next_which"].startswith("liba.so:")
    assert runs.plain["b_next_which"] == "null"
    assert runs.pre["cgpu.a:which@"] != "(nil)"
    pairs = {
        k[5:]: (v, runs.pre["glibc." + k[5:]])
        for k, v in runs.pre.items()
        if k.startswith("cgpu.") and "glibc." + k[5:] in runs.pre
    }
    assert len(pairs) == 16
    assert {k: cg for k, (cg, _) in pairs.items()} == {k: gl for k, (_, gl) in pairs.items()}
    assert runs.pre["tls_ok"] == "1"
    assert runs.pre["cgpu.bogus_caller"] == "null"


def test_versioned_next_lookups(runs: Runs) -> None:
    # Two distinct pthread_cond_wait versions, so picking one is observable.
    assert runs.plain["a_next_condwait_2.2.5"] != runs.plain["a_next_condwait"]
    for key in ("a_next_condwait_2.2.5", "a_next_condwait", "a_next_memcpy_2.2.5", "a_next_memcpy_2.14"):
        assert runs.pre[key] == runs.plain[key] != "null", key
    assert runs.pre["a_next_memcpy_9.9"] == "null"
    assert runs.pre["cgpu.a:pthread_cond_wait@GLIBC_2.2.5"] != runs.pre["cgpu.a:pthread_cond_wait@"]
    # memcpy@@GLIBC_2.14 is an IFUNC: the answer must be the implementation,
    # not its resolver. Default, old and new version all copy.
    assert runs.pre["cgpu_memcpy_copies"] == "1,1,1"


def test_sanitizer_runtime_resolves_its_interceptors_through_the_hook(runs: Runs) -> None:
    # Only the ASan runtime calls dlsym before main; in that build this proves
    # the path where the hook runs before ASan's shadow memory exists.
    startup_calls = int(runs.pre["startup_calls"])
    assert startup_calls > 0 if runs.sanitized else startup_calls == 0


def test_resolver_is_internal_and_hash_styles_are_as_built(runs: Runs) -> None:
    nm, readelf = shutil.which("nm"), shutil.which("readelf")
    if nm is None or readelf is None:
        pytest.skip("binutils not installed")
    exported = subprocess.run(
        [nm, "-D", "--defined-only", str(runs.dir / "libpreloaded.so")], capture_output=True, text=True, check=True
    ).stdout
    assert " dlsym" in exported and "cgpu_" not in exported
    dyn_b = subprocess.run([readelf, "-d", str(runs.dir / "libb.so")], capture_output=True, text=True).stdout
    dyn_a = subprocess.run([readelf, "-d", str(runs.dir / "liba.so")], capture_output=True, text=True).stdout
    assert "(HASH)" in dyn_b and "GNU_HASH" not in dyn_b
    assert "GNU_HASH" in dyn_a and "(HASH)" not in dyn_a
