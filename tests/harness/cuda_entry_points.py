"""The driver entry points libcgpu.so hooks, and which of those the CUDA
runtime names allocate device memory (or seem to and do not, with why)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOOKED = set(re.findall(r"^HOOK\((\w+)", (ROOT / "csrc/intercept/hooks.def").read_text(), re.MULTILINE))

# Driver entry points the CUDA runtime names that create device memory, and
# where each lands; anything else that allocates must be added here and hooked.
ALLOCATING_IN_CUDART = {
    "cuMemAlloc": "cuMemAlloc_v2",
    "cuMemAlloc_v2": "cuMemAlloc_v2",
    "cuMemAllocPitch": "cuMemAllocPitch_v2",
    "cuMemAllocPitch_v2": "cuMemAllocPitch_v2",
    "cuMemAllocManaged": "cuMemAllocManaged",
    "cuMemAllocAsync": "cuMemAllocAsync",
    "cuMemAllocAsync_ptsz": "cuMemAllocAsync_ptsz",
    "cuMemAllocFromPoolAsync": "cuMemAllocFromPoolAsync",
    "cuMemAllocFromPoolAsync_ptsz": "cuMemAllocFromPoolAsync_ptsz",
    "cuArrayCreate": "cuArrayCreate_v2",
    "cuArrayCreate_v2": "cuArrayCreate_v2",
    "cuArray3DCreate": "cuArray3DCreate_v2",
    "cuArray3DCreate_v2": "cuArray3DCreate_v2",
    "cuMipmappedArrayCreate": "cuMipmappedArrayCreate",
    "cuGraphAddMemAllocNode": "cuGraphAddMemAllocNode",  # refused under a limit
}
# Named by the runtime and matching the allocation patterns below, but not
# new device memory of this instance, with the reason.
NOT_INSTANCE_MEMORY = {
    "cuMemHostAlloc": "page-locked host memory",
    "cuMemHostRegister": "registers existing host memory",
    "cuMemHostRegister_v2": "registers existing host memory",
    "cuMemPoolImportPointer": "maps memory another process allocated (and was charged for)",
    "cuIpcOpenMemHandle": "maps memory another process allocated",
    "cuIpcOpenMemHandle_v2": "same",
    "cuImportExternalMemory": "maps memory a graphics API allocated",
    "cuExternalMemoryGetMappedBuffer": "same",
    "cuExternalMemoryGetMappedMipmappedArray": "same",
    "cuGraphicsResourceGetMappedPointer": "graphics interop",
    "cuGraphicsResourceGetMappedPointer_v2": "same",
    "cuGraphicsResourceGetMappedMipmappedArray": "graphics interop",
    "cuGraphicsSubResourceGetMappedArray": "same",
    "cuMipmappedArrayGetLevel": "a view of an existing array",
    "cuMemPoolCreate": "a pool allocates through cuMemAllocFromPoolAsync",
    "cuGraphMemAllocNodeGetParams": "a query",
    "cuMemPoolImportFromShareableHandle": "opens another process's pool",
    "cuImportExternalSemaphore": "a semaphore, no memory",
    "cuDeviceRegisterAsyncNotification": "a callback",
    "cuLogsRegisterCallback": "a callback",
    "cuGLRegisterBufferObject": "graphics interop: memory OpenGL allocated",
    "cuGraphicsGLRegisterBuffer": "same",
    "cuGraphicsGLRegisterImage": "same",
    "cuGraphicsEGLRegisterImage": "same",
    "cuGraphicsVDPAURegisterOutputSurface": "same",
    "cuGraphicsVDPAURegisterVideoSurface": "same",
}
ALLOC_PATTERN = re.compile(r"^cu\w*(Alloc|ArrayCreate|Import|Register|MemCreate|Mipmapped\w*Create)\w*$")
