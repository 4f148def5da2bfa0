/* What libcgpu.so does: export dlsym/dlvsym and forward through resolve.c.
 * The counters and shim_* entry points exist only for the test program. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stddef.h>

#include "resolve.h"

#define EXPORT __attribute__((visibility("default")))

static atomic_long dlsym_calls, dlvsym_calls;

EXPORT CGPU_NO_ASAN void *dlsym(void *handle, const char *name)
{
	cgpu_dlsym_fn real;

	atomic_fetch_add(&dlsym_calls, 1);
	if (handle == RTLD_NEXT)
		return cgpu_dlsym_next(__builtin_return_address(0), name, NULL);
	real = cgpu_real_dlsym();
	return real ? real(handle, name) : NULL;
}

EXPORT CGPU_NO_ASAN void *dlvsym(void *handle, const char *name, const char *version)
{
	cgpu_dlvsym_fn real;

	atomic_fetch_add(&dlvsym_calls, 1);
	if (handle == RTLD_NEXT)
		return cgpu_dlsym_next(__builtin_return_address(0), name, version);
	real = cgpu_real_dlvsym();
	return real ? real(handle, name, version) : NULL;
}

EXPORT long shim_dlsym_calls(void) { return atomic_load(&dlsym_calls); }
EXPORT long shim_dlvsym_calls(void) { return atomic_load(&dlvsym_calls); }
EXPORT cgpu_dlsym_fn shim_real_dlsym(void) { return cgpu_real_dlsym(); }
EXPORT cgpu_dlvsym_fn shim_real_dlvsym(void) { return cgpu_real_dlvsym(); }
EXPORT void *shim_dlsym_next(const void *caller, const char *name, const char *version)
{
	return cgpu_dlsym_next(caller, name, version);
}
