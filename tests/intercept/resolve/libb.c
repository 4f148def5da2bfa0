/* Second definer of which(), built with only a DT_HASH table, plus a TLS
 * variable: both need the slower paths of the resolver. */
#define _GNU_SOURCE
#include <dlfcn.h>

typedef void *(*dlsym_fn)(void *, const char *);

_Thread_local int b_tlsvar;

int which(void) { return 2; }
int *b_tls(void) { return &b_tlsvar; }
void *b_next(const char *name) { return dlsym(RTLD_NEXT, name); }
void *b_next_with(dlsym_fn ds, const char *name) { return ds(RTLD_NEXT, name); }
