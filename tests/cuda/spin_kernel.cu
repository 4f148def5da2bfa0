// The portable spin kernel alone, with C linkage, for programs that load it
// from a fatbin or PTX file (tests/cuda/runtime_steps.c): nvcc -fatbin / -ptx.
extern "C" __global__ void cgpu_spin(unsigned long long ns)
{
    unsigned long long start;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    for (;;) {
        unsigned long long now;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
        if (now - start >= ns)
            break;
    }
}
