/* Prints key=value lines for test_resolve.py. Run twice: without the preload
 * (every answer is glibc's) and with it (shim_* present, dlsym is the hook).
 * "desc" values are file:offset so they compare across the two processes. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef void *(*dlsym_fn)(void *, const char *);
typedef void *(*dlvsym_fn)(void *, const char *, const char *);
typedef void *(*memcpy_fn)(void *, const void *, size_t);

int which(void);
int *b_tls(void);
void *a_next(const char *name);
void *a_nextv(const char *name, const char *version);
void *a_next_with(dlsym_fn ds, const char *name);
void *a_nextv_with(dlvsym_fn dvs, const char *name, const char *version);
void *b_next(const char *name);
void *b_next_with(dlsym_fn ds, const char *name);

/* Defined only by the preloaded shim; NULL in the run without it. */
extern long shim_dlsym_calls(void) __attribute__((weak));
extern long shim_dlvsym_calls(void) __attribute__((weak));
extern dlsym_fn shim_real_dlsym(void) __attribute__((weak));
extern dlvsym_fn shim_real_dlvsym(void) __attribute__((weak));
extern void *shim_dlsym_next(const void *caller, const char *name, const char *version)
	__attribute__((weak));

static void desc(const char *key, const void *p)
{
	Dl_info di;
	const char *base;

	if (!p) {
		printf("%s=null\n", key);
		return;
	}
	if (!dladdr(p, &di) || !di.dli_fname) {
		printf("%s=unknown\n", key);
		return;
	}
	base = strrchr(di.dli_fname, '/');
	printf("%s=%s:%#lx\n", key, base ? base + 1 : di.dli_fname,
	       (unsigned long)((uintptr_t)p - (uintptr_t)di.dli_fbase));
}

static int copies(const void *fn)
{
	char src[32] = "resolved through RTLD_NEXT", dst[32] = { 0 };

	if (!fn)
		return 0;
	((memcpy_fn)(uintptr_t)fn)(dst, src, sizeof src);
	return memcmp(src, dst, sizeof src) == 0;
}

struct next_case {
	char caller; /* a = liba, b = libb, m = this program */
	const char *name, *version;
};

static const struct next_case cases[] = {
	{ 'a', "which", NULL }, { 'a', "no_such_symbol", NULL }, { 'a', "b_tlsvar", NULL },
	{ 'a', "memcpy", NULL }, { 'a', "memcpy", "GLIBC_2.2.5" }, { 'a', "memcpy", "GLIBC_2.14" },
	{ 'a', "memcpy", "GLIBC_9.9" }, { 'a', "pthread_cond_wait", NULL },
	{ 'a', "pthread_cond_wait", "GLIBC_2.2.5" }, { 'a', "which", "GLIBC_2.2.5" },
	{ 'm', "which", NULL }, { 'm', "dlsym", NULL }, { 'm', "dlvsym", "GLIBC_2.34" },
	{ 'm', "memcpy", "GLIBC_2.14" }, { 'b', "which", NULL }, { 'b', "b_tlsvar", NULL },
};

/* glibc's own answer: libc's dlsym/dlvsym called from code in the caller. */
static void *glibc_next(const struct next_case *c, dlsym_fn ds, dlvsym_fn dvs)
{
	if (c->caller == 'a')
		return c->version ? a_nextv_with(dvs, c->name, c->version) : a_next_with(ds, c->name);
	if (c->caller == 'b')
		return c->version ? NULL : b_next_with(ds, c->name);
	return c->version ? dvs(RTLD_NEXT, c->name, c->version) : ds(RTLD_NEXT, c->name);
}

static void compare_next(dlsym_fn libc_dlsym, dlvsym_fn libc_dlvsym)
{
	for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
		const struct next_case *c = &cases[i];
		const void *caller = c->caller == 'a' ? (const void *)(uintptr_t)a_next_with
				   : c->caller == 'b' ? (const void *)(uintptr_t)b_next_with
				   : (const void *)(uintptr_t)compare_next;
		char key[96];

		snprintf(key, sizeof key, "%c:%s@%s", c->caller, c->name, c->version ? c->version : "");
		printf("cgpu.%s=%p\n", key, shim_dlsym_next(caller, c->name, c->version));
		printf("glibc.%s=%p\n", key, glibc_next(c, libc_dlsym, libc_dlvsym));
	}
	printf("tls_ok=%d\n", shim_dlsym_next((const void *)(uintptr_t)a_next_with, "b_tlsvar", NULL) ==
				      (void *)b_tls());
	desc("cgpu.bogus_caller", shim_dlsym_next((const void *)16, "which", NULL));
	printf("cgpu_memcpy_copies=%d,%d,%d\n",
	       copies(shim_dlsym_next((const void *)(uintptr_t)a_next_with, "memcpy", NULL)),
	       copies(shim_dlsym_next((const void *)(uintptr_t)a_next_with, "memcpy", "GLIBC_2.2.5")),
	       copies(shim_dlsym_next((const void *)(uintptr_t)a_next_with, "memcpy", "GLIBC_2.14")));
}

static void preloaded_only(void *libc)
{
	dlsym_fn real = shim_real_dlsym();
	dlvsym_fn realv = shim_real_dlvsym();
	long before = shim_dlsym_calls(), beforev = shim_dlvsym_calls();
	void *p = dlsym(RTLD_DEFAULT, "which");
	void *q = dlvsym(libc, "memcpy", "GLIBC_2.2.5");

	printf("dlsym_delta=%ld\ndlvsym_delta=%ld\n", shim_dlsym_calls() - before,
	       shim_dlvsym_calls() - beforev);
	desc("hooked_default_which", p);
	desc("hooked_libc_memcpy_2.2.5", q);
	desc("real_dlsym", (const void *)(uintptr_t)real);
	desc("real_dlvsym", (const void *)(uintptr_t)realv);
	desc("real_dlsym_default_which", real ? real(RTLD_DEFAULT, "which") : NULL);
	desc("real_dlvsym_libc_memcpy_2.2.5", realv ? realv(libc, "memcpy", "GLIBC_2.2.5") : NULL);
	compare_next((dlsym_fn)(uintptr_t)dlsym(libc, "dlsym"),
		     (dlvsym_fn)(uintptr_t)dlsym(libc, "dlvsym"));
}

int main(void)
{
	void *libc = dlopen("libc.so.6", RTLD_LAZY | RTLD_NOLOAD);
	void *libb = dlopen("libb.so", RTLD_LAZY | RTLD_NOLOAD);

	if (!libc || !libb) {
		fprintf(stderr, "dlopen NOLOAD failed: %s\n", dlerror());
		return 2;
	}
	/* Under ASan the sanitizer runtime looked up its interceptors before main. */
	if (shim_dlsym_calls && shim_dlvsym_calls)
		printf("startup_calls=%ld\n", shim_dlsym_calls() + shim_dlvsym_calls());
	printf("preloaded=%d\nwhich=%d\n", shim_dlsym_calls != NULL, which());
	desc("default_which", dlsym(RTLD_DEFAULT, "which"));
	desc("handle_b_which", dlsym(libb, "which"));
	desc("libc_dlsym", dlsym(libc, "dlsym"));
	desc("libc_dlvsym", dlsym(libc, "dlvsym"));
	desc("a_next_which", a_next("which"));
	desc("main_next_which", dlsym(RTLD_NEXT, "which"));
	desc("b_next_which", b_next("which"));
	desc("a_next_memcpy_2.2.5", a_nextv("memcpy", "GLIBC_2.2.5"));
	desc("a_next_memcpy_2.14", a_nextv("memcpy", "GLIBC_2.14"));
	desc("a_next_condwait_2.2.5", a_nextv("pthread_cond_wait", "GLIBC_2.2.5"));
	desc("a_next_condwait", a_next("pthread_cond_wait"));
	desc("a_next_memcpy_9.9", a_nextv("memcpy", "GLIBC_9.9"));
	if (shim_dlsym_calls && shim_dlvsym_calls && shim_real_dlsym && shim_real_dlvsym && shim_dlsym_next)
		preloaded_only(libc);
	dlclose(libb);
	dlclose(libc);
	return 0;
}
