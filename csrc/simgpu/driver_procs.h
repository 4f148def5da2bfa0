/* The simulated driver's cuGetProcAddress table rows, shared by the
 * modelled entry points (driver_core.c) and the generated stubs
 * (driver_stubs.c, which must not see any cuda.h: see there). */
#ifndef CGPU_SIM_DRIVER_PROCS_H
#define CGPU_SIM_DRIVER_PROCS_H

#include <stddef.h>

enum sim_proc_kind { SIM_PROC_DEFAULT, SIM_PROC_PTSZ };

struct sim_proc {
    const char *base;             /* the name a runtime asks for */
    int since;                    /* first CUDA version answered with fn */
    enum sim_proc_kind kind;      /* PTSZ: the per-thread default stream variant */
    void *fn;
};

/* cuda_unmodelled.def's answers, each a stub. */
extern const struct sim_proc sim_stub_procs[];
extern const size_t sim_stub_proc_count;

#endif
