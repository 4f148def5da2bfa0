/* Forced into every libcgpu.so source (-include): the library is preloaded
 * into container images whatever their glibc, and ld.so skips a preload
 * whose symbol versions the image's libc lacks, leaving the container
 * unlimited. So libcgpu binds only versions glibc 2.17 already had (the
 * manylinux2014 floor): glibc 2.34 moved dlopen and pthread_* into libc
 * under new versions but keeps these old ones, and on older images they
 * come from libdl.so.2 and libpthread.so.0, which the build links
 * unconditionally. tests/unit/test_glibc_baseline.py checks the result.
 * No state; safe from any thread. */
#ifndef CGPU_GLIBC_BASELINE_H
#define CGPU_GLIBC_BASELINE_H

#if defined(__GLIBC__) || defined(__linux__)
#if defined(__x86_64__)
__asm__(".symver dlopen,dlopen@GLIBC_2.2.5");
__asm__(".symver dlclose,dlclose@GLIBC_2.2.5");
__asm__(".symver pthread_create,pthread_create@GLIBC_2.2.5");
__asm__(".symver pthread_sigmask,pthread_sigmask@GLIBC_2.2.5");
__asm__(".symver pthread_setname_np,pthread_setname_np@GLIBC_2.12");
#endif
#endif

#endif
