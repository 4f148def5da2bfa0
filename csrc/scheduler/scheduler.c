#include "scheduler.h"

#include <stdlib.h>

struct cgpu_sched {
    unsigned gpu_count;
};

int cgpu_sched_abi_version(void)
{
    return CGPU_SCHED_ABI_VERSION;
}

struct cgpu_sched *cgpu_sched_create(unsigned gpu_count)
{
    if (gpu_count == 0)
        return NULL;
    struct cgpu_sched *s = calloc(1, sizeof(*s));
    if (s)
        s->gpu_count = gpu_count;
    return s;
}

unsigned cgpu_sched_gpu_count(const struct cgpu_sched *s)
{
    return s ? s->gpu_count : 0;
}

void cgpu_sched_destroy(struct cgpu_sched *s)
{
    free(s);
}
