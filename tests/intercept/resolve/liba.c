/* First of two libraries defining which(): RTLD_NEXT from here must reach libb. */
#define _GNU_SOURCE
#include <dlfcn.h>

typedef void *(*dlsym_fn)(void *, const char *);
typedef void *(*dlvsym_fn)(void *, const char *, const char *);

int which(void) { return 1; }

/* Through whichever dlsym the process binds: the preloaded hook, or glibc's. */
void *a_next(const char *name) { return dlsym(RTLD_NEXT, name); }
void *a_nextv(const char *name, const char *version) { return dlvsym(RTLD_NEXT, name, version); }

/* Through libc's own functions called from here, so glibc takes liba as the
 * caller (built without sibling calls: the return address must stay here). */
void *a_next_with(dlsym_fn ds, const char *name) { return ds(RTLD_NEXT, name); }
void *a_nextv_with(dlvsym_fn dvs, const char *name, const char *version)
{
	return dvs(RTLD_NEXT, name, version);
}
