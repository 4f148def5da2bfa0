/* Another preloaded dlsym interposer (a profiler, say), exported under
 * glibc's own version names: the real-dlsym search must not pick it. */
#define _GNU_SOURCE
#include <stddef.h>

void *dlsym(void *handle, const char *name);
void *dlvsym(void *handle, const char *name, const char *version);

void *dlsym(void *handle, const char *name)
{
	(void)handle, (void)name;
	return NULL;
}

void *dlvsym(void *handle, const char *name, const char *version)
{
	(void)handle, (void)name, (void)version;
	return NULL;
}
