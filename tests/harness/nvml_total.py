"""A tiny NVML client for inside containers: it prints the total memory NVML
reports for GPU 0, as `NVML_TOTAL=<bytes>`."""

from __future__ import annotations

import subprocess
from pathlib import Path

# NVML's view from inside the container: the driver library the toolkit
# mounted, found by dlopen as any NVML program finds it.
NVML_TOTAL = r"""
#include <dlfcn.h>
#include <stdio.h>
typedef struct { unsigned long long total, free, used; } mem_t;
int main(void) {
    void *h = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!h) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 2; }
    int (*init)(void) = (int (*)(void))dlsym(h, "nvmlInit_v2");
    int (*get)(unsigned, void **) = (int (*)(unsigned, void **))dlsym(h, "nvmlDeviceGetHandleByIndex_v2");
    int (*info)(void *, mem_t *) = (int (*)(void *, mem_t *))dlsym(h, "nvmlDeviceGetMemoryInfo");
    void *dev; mem_t m;
    if (!init || !get || !info || init() || get(0, &dev) || info(dev, &m)) return 3;
    printf("NVML_TOTAL=%llu\n", m.total);
    return 0;
}
"""


def build_nvml_total(out: Path, source: Path | None = None) -> Path:
    """Compiles the client to out (its source written to `source`, by
    default next to out)."""
    source = source or out.with_name("nvml_total.c")
    source.write_text(NVML_TOTAL)
    subprocess.run(["cc", "-O1", "-o", str(out), str(source), "-ldl"], check=True, capture_output=True)
    return out
