/* Finding the C library's dlsym/dlvsym, and answering dlsym(RTLD_NEXT, ...)
 * for a caller, from inside a library that interposes dlsym itself (so it
 * cannot call dlsym to do either).
 * Ownership: returned pointers belong to loaded objects, nothing to free;
 * thread-safety: every function may be called from any thread at any time,
 * including from constructors and from inside the dlsym hook. */
#ifndef CGPU_INTERCEPT_RESOLVE_H
#define CGPU_INTERCEPT_RESOLVE_H

/* Internal to the object that links this in: an exported resolver could
 * itself be interposed by another preloaded library. */
#define CGPU_RESOLVE_API __attribute__((visibility("hidden")))

/* The ASan runtime looks up its interceptors with dlsym(RTLD_NEXT) -- our
 * hook -- before it maps its shadow memory, so in sanitizer builds the hook and
 * everything it calls must carry this or crash on the first stack access. */
#define CGPU_NO_ASAN __attribute__((no_sanitize("address")))

typedef void *(*cgpu_dlsym_fn)(void *handle, const char *name);
typedef void *(*cgpu_dlvsym_fn)(void *handle, const char *name, const char *version);

/* The C library's own dlsym / dlvsym (default version), found by reading
 * libc's dynamic symbol table (dl_iterate_phdr + DT_GNU_HASH, falling back to
 * DT_HASH), never by calling dlsym. NULL if not found (musl has no dlvsym).
 * Cached after the first call. */
CGPU_RESOLVE_API cgpu_dlsym_fn cgpu_real_dlsym(void);
CGPU_RESOLVE_API cgpu_dlvsym_fn cgpu_real_dlvsym(void);

/* What dlsym(RTLD_NEXT, name) (version == NULL) or dlvsym(RTLD_NEXT, name,
 * version) returns when called from the object containing `caller`: the first
 * definition in the objects loaded after the caller's. NULL when there is
 * none or `caller` is in no loaded object. */
CGPU_RESOLVE_API void *cgpu_dlsym_next(const void *caller, const char *name, const char *version);

#endif
