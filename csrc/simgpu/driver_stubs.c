/* Simulated libcuda.so.1: every entry point of a real driver that the
 * simulation does not model (cuda_unmodelled.def, generated from the
 * toolkit's headers) answers CUDA_ERROR_NOT_SUPPORTED, as a real driver does
 * for a feature its GPU or platform lacks, so programs linked against any of
 * them load, and cuGetProcAddress hands them out under their real names.
 *
 * Each stub is defined as `int symbol(void)`, not with its cuda.h prototype:
 * on the ABIs the simulator builds for (x86-64 System V, AArch64 AAPCS) the
 * caller passes arguments in registers and on its own stack frame and
 * cleans up after the call, so a callee that reads none of them and returns
 * an int-sized enum in the return register behaves the same whatever the
 * caller passed. A variadic stub would not be equivalent (x86-64 callers of
 * variadics set %al; Apple's AArch64 moves variadic arguments to the stack).
 * This file therefore includes no cuda.h: with NVIDIA's header (the
 * real-cuda-h build) the prototypes would conflict. tests/abi checks each
 * stub's params in cuda_unmodelled.def against that header instead. */
#include "driver_procs.h"

#define STUB_EXPORT __attribute__((visibility("default")))
/* CUDA_ERROR_NOT_SUPPORTED; driver_core.c asserts the two agree. */
#define STUB_NOT_SUPPORTED 801

#define CU_STUB(symbol, params) STUB_EXPORT int symbol(void);
#define CU_PROC(symbol, base, since, kind)
#include "cuda_unmodelled.def"
#undef CU_STUB
#undef CU_PROC

#define CU_STUB(symbol, params) \
    int symbol(void) { return STUB_NOT_SUPPORTED; }
#define CU_PROC(symbol, base, since, kind)
#include "cuda_unmodelled.def"
#undef CU_STUB
#undef CU_PROC

const struct sim_proc sim_stub_procs[] = {
#define CU_STUB(symbol, params)
#define CU_PROC(symbol, base, since, kind) {#base, since, SIM_PROC_##kind, (void *)symbol},
#include "cuda_unmodelled.def"
#undef CU_STUB
#undef CU_PROC
};
const size_t sim_stub_proc_count = sizeof(sim_stub_procs) / sizeof(sim_stub_procs[0]);
