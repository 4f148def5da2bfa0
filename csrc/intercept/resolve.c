/* libcgpu.so interposes dlsym and dlvsym, so it cannot call them to find the
 * real ones: an unversioned preloaded definition can satisfy even a versioned
 * reference, and __libc_dlsym/_dl_sym are private. Instead we read the dynamic
 * symbol tables ld.so has already mapped. The acceptance rules copy glibc's
 * check_match/do_lookup_x (elf/dl-lookup.c) so answers match the real dlsym. */
#define _GNU_SOURCE
#include "resolve.h"

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/auxv.h>

struct elf_obj {
	ElfW(Addr) base;
	const char *strtab;
	size_t strsz;
	const ElfW(Sym) *symtab;
	const uint32_t *gnu_hash, *sysv_hash;
	const ElfW(Half) *versym;
	const ElfW(Verdef) *verdef;
};

/* Symbol types dlsym will return (glibc's ALLOWED_STT). */
#define ALLOWED_STT ((1u << STT_NOTYPE) | (1u << STT_OBJECT) | (1u << STT_FUNC) | \
		     (1u << STT_COMMON) | (1u << STT_TLS) | (1u << STT_GNU_IFUNC))
#define VERSYM_HIDDEN 0x8000u
#define NOT_FOUND ((uintptr_t)1) /* cached "looked, absent"; 0 means "not looked yet" */

/* Not libc's string functions: under ASan those are interceptors that are not
 * wired up yet when the runtime's own dlsym calls reach us. */
static CGPU_NO_ASAN bool starts_with(const char *s, const char *prefix)
{
	while (*prefix && *s == *prefix)
		s++, prefix++;
	return *prefix == '\0';
}

static CGPU_NO_ASAN bool same(const char *a, const char *b)
{
	while (*a && *a == *b)
		a++, b++;
	return *a == *b;
}

static CGPU_NO_ASAN bool contains(const struct dl_phdr_info *info, const void *addr)
{
	uintptr_t a = (uintptr_t)addr;

	for (ElfW(Half) i = 0; i < info->dlpi_phnum; i++) {
		const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
		uintptr_t lo = info->dlpi_addr + ph->p_vaddr;

		if (ph->p_type == PT_LOAD && a >= lo && a - lo < ph->p_memsz)
			return true;
	}
	return false;
}

/* ld.so rewrites d_ptr to run-time addresses on x86_64, but not where the
 * dynamic section is read-only (the vdso, MIPS, RISC-V). */
static CGPU_NO_ASAN const void *dyn_ptr(ElfW(Addr) base, ElfW(Addr) p)
{
	return (const void *)(p < base ? p + base : p);
}

static CGPU_NO_ASAN bool load_obj(const struct dl_phdr_info *info, struct elf_obj *o)
{
	const ElfW(Dyn) *dyn = NULL;

	*o = (struct elf_obj){ .base = info->dlpi_addr };
	for (ElfW(Half) i = 0; i < info->dlpi_phnum; i++)
		if (info->dlpi_phdr[i].p_type == PT_DYNAMIC)
			dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
	for (; dyn && dyn->d_tag != DT_NULL; dyn++) {
		const void *p = dyn_ptr(o->base, dyn->d_un.d_ptr);

		switch (dyn->d_tag) {
		case DT_STRTAB: o->strtab = p; break;
		case DT_STRSZ: o->strsz = dyn->d_un.d_val; break;
		case DT_SYMTAB: o->symtab = p; break;
		case DT_GNU_HASH: o->gnu_hash = p; break;
		case DT_HASH: o->sysv_hash = p; break;
		case DT_VERSYM: o->versym = p; break;
		case DT_VERDEF: o->verdef = p; break;
		default: break;
		}
	}
	return o->strtab && o->symtab && (o->gnu_hash || o->sysv_hash);
}

/* Name of version index `ndx` among the versions this object defines. */
static CGPU_NO_ASAN const char *version_name(const struct elf_obj *o, unsigned ndx)
{
	for (const char *vd = (const char *)o->verdef; vd;) {
		const ElfW(Verdef) *d = (const ElfW(Verdef) *)vd;

		if (d->vd_ndx == ndx && d->vd_cnt > 0)
			return o->strtab + ((const ElfW(Verdaux) *)(vd + d->vd_aux))->vda_name;
		vd = d->vd_next ? vd + d->vd_next : NULL;
	}
	return NULL;
}

struct match {
	const char *name, *version;
	const ElfW(Sym) *sym, *newest; /* newest: the one default (@@) definition seen */
	unsigned ndefault;
};

/* dlvsym wants exactly `version`; dlsym takes an unversioned definition at
 * once, else the single default (@@) one, which lookup() picks afterwards. */
static CGPU_NO_ASAN bool version_ok(const struct elf_obj *o, uint32_t ix, struct match *m)
{
	unsigned ndx;

	if (!o->versym)
		return true;
	ndx = o->versym[ix] & ~VERSYM_HIDDEN;
	if (m->version) {
		const char *v = version_name(o, ndx);

		return v && same(v, m->version);
	}
	if (ndx < 2)
		return true;
	if (!(o->versym[ix] & VERSYM_HIDDEN) && m->ndefault++ == 0)
		m->newest = &o->symtab[ix];
	return false;
}

/* True when the search stops at symbol ix. */
static CGPU_NO_ASAN bool check(const struct elf_obj *o, uint32_t ix, struct match *m)
{
	const ElfW(Sym) *s = &o->symtab[ix];
	unsigned type = ELF64_ST_TYPE(s->st_info), bind = ELF64_ST_BIND(s->st_info);

	if (s->st_shndx == SHN_UNDEF || !((ALLOWED_STT >> type) & 1u) ||
	    (s->st_value == 0 && s->st_shndx != SHN_ABS && type != STT_TLS) ||
	    (bind != STB_GLOBAL && bind != STB_WEAK && bind != STB_GNU_UNIQUE) ||
	    (o->strsz && s->st_name >= o->strsz) || !same(o->strtab + s->st_name, m->name) ||
	    !version_ok(o, ix, m))
		return false;
	m->sym = s;
	return true;
}

static CGPU_NO_ASAN uint32_t gnu_hash(const char *name)
{
	uint32_t h = 5381;

	for (const unsigned char *p = (const unsigned char *)name; *p; p++)
		h = h * 33 + *p;
	return h;
}

static CGPU_NO_ASAN uint32_t sysv_hash(const char *name)
{
	uint32_t h = 0;

	for (const unsigned char *p = (const unsigned char *)name; *p; p++) {
		h = (h << 4) + *p;
		h = (h ^ ((h & 0xf0000000u) >> 24)) & 0x0fffffffu;
	}
	return h;
}

static CGPU_NO_ASAN void walk_gnu(const struct elf_obj *o, struct match *m)
{
	const uint32_t *hdr = o->gnu_hash;
	uint32_t nbuckets = hdr[0], symoffset = hdr[1], bloom_size = hdr[2], shift = hdr[3];
	const ElfW(Addr) *bloom = (const ElfW(Addr) *)(hdr + 4);
	const uint32_t *buckets = (const uint32_t *)(bloom + bloom_size);
	const uint32_t *chain = buckets + nbuckets;
	const uint32_t bits = sizeof(ElfW(Addr)) * 8, h = gnu_hash(m->name);
	ElfW(Addr) mask = ((ElfW(Addr))1 << (h % bits)) | ((ElfW(Addr))1 << ((h >> (shift % 32)) % bits));
	uint32_t ix;

	if (nbuckets == 0 || bloom_size == 0 || (bloom[(h / bits) % bloom_size] & mask) != mask)
		return;
	ix = buckets[h % nbuckets];
	for (uint32_t ch = 0; ix != 0 && ix >= symoffset && !(ch & 1); ix++) {
		ch = chain[ix - symoffset];
		if ((ch | 1) == (h | 1) && check(o, ix, m))
			return;
	}
}

static CGPU_NO_ASAN void walk_sysv(const struct elf_obj *o, struct match *m)
{
	uint32_t nbucket = o->sysv_hash[0], nchain = o->sysv_hash[1];
	const uint32_t *bucket = o->sysv_hash + 2, *chain = bucket + nbucket;

	if (nbucket == 0)
		return;
	/* nchain bounds both the index and the walk, so a corrupt chain ends. */
	for (uint32_t ix = bucket[sysv_hash(m->name) % nbucket], n = 0;
	     ix != STN_UNDEF && ix < nchain && n < nchain; ix = chain[ix], n++)
		if (check(o, ix, m))
			return;
}

static CGPU_NO_ASAN const ElfW(Sym) *lookup(const struct elf_obj *o, const char *name, const char *version)
{
	struct match m = { .name = name, .version = version };

	if (o->gnu_hash)
		walk_gnu(o, &m);
	else
		walk_sysv(o, &m);
	if (!m.sym && m.ndefault == 1)
		m.sym = m.newest;
	return m.sym;
}

static CGPU_NO_ASAN uintptr_t sym_addr(const struct elf_obj *o, const ElfW(Sym) *s)
{
	return (s->st_shndx == SHN_ABS ? 0 : o->base) + s->st_value;
}

struct libc_search {
	const char *name;
	const void *self; /* anything inside our own object, which we skip */
	bool by_glibc_version;
	uintptr_t addr;
};

static CGPU_NO_ASAN bool libc_file(const char *path)
{
	const char *base = path;

	for (const char *p = path; *p; p++)
		if (*p == '/')
			base = p + 1;
	return starts_with(base, "libc.so") || starts_with(base, "libdl.so") || starts_with(base, "ld-musl");
}

/* Other preloaded interposers export dlsym too, some even with a GLIBC_
 * version, so trust the C library's file name first (libc.so.6 from glibc
 * 2.34, libdl.so.2 before, musl's libc.so); a GLIBC_ version is the fallback
 * for a glibc installed under another name. */
static CGPU_NO_ASAN int libc_cb(struct dl_phdr_info *info, size_t size, void *data)
{
	struct libc_search *s = data;
	struct elf_obj o;
	const ElfW(Sym) *sym;
	const char *ver;

	(void)size;
	if (contains(info, s->self) || !load_obj(info, &o))
		return 0;
	sym = lookup(&o, s->name, NULL);
	if (!sym || ELF64_ST_TYPE(sym->st_info) != STT_FUNC)
		return 0;
	ver = o.versym ? version_name(&o, o.versym[sym - o.symtab] & ~VERSYM_HIDDEN) : NULL;
	if (s->by_glibc_version ? !(ver && starts_with(ver, "GLIBC_")) : !libc_file(info->dlpi_name))
		return 0;
	s->addr = sym_addr(&o, sym);
	return 1;
}

static CGPU_NO_ASAN uintptr_t find_real(_Atomic uintptr_t *slot, const char *name)
{
	uintptr_t v = atomic_load_explicit(slot, memory_order_acquire);

	if (v == 0) { /* racing threads compute the same answer; either store wins */
		struct libc_search s = { .name = name, .self = slot };

		if (!dl_iterate_phdr(libc_cb, &s)) {
			s.by_glibc_version = true;
			dl_iterate_phdr(libc_cb, &s);
		}
		v = s.addr ? s.addr : NOT_FOUND;
		atomic_store_explicit(slot, v, memory_order_release);
	}
	return v == NOT_FOUND ? 0 : v;
}

static _Atomic uintptr_t real_dlsym_addr, real_dlvsym_addr;

CGPU_NO_ASAN cgpu_dlsym_fn cgpu_real_dlsym(void)
{
	uintptr_t a = find_real(&real_dlsym_addr, "dlsym");
	return a ? (cgpu_dlsym_fn)a : NULL;
}

CGPU_NO_ASAN cgpu_dlvsym_fn cgpu_real_dlvsym(void)
{
	uintptr_t a = find_real(&real_dlvsym_addr, "dlvsym");
	return a ? (cgpu_dlvsym_fn)a : NULL;
}

struct next_search {
	const void *caller, *vdso;
	const char *name, *version;
	bool past_caller;
	struct elf_obj obj;
	const ElfW(Sym) *sym;
	const char *obj_name; /* of the object defining sym */
};

/* Load order is search order for the objects loaded at start-up (ld.so puts
 * itself in place); the vdso is listed but never searched. */
static CGPU_NO_ASAN int next_cb(struct dl_phdr_info *info, size_t size, void *data)
{
	struct next_search *s = data;

	(void)size;
	if (!s->past_caller) {
		s->past_caller = contains(info, s->caller);
		return 0;
	}
	if ((s->vdso && contains(info, s->vdso)) || !load_obj(info, &s->obj))
		return 0;
	s->sym = lookup(&s->obj, s->name, s->version);
	s->obj_name = info->dlpi_name;
	return s->sym != NULL;
}

/* A TLS variable must be located for this thread, and an IFUNC resolved as
 * ld.so would (arguments differ per architecture): ask ld.so through a handle
 * of the defining object, whose own definition a handle lookup finds first. */
static CGPU_NO_ASAN void *via_handle(const char *obj_name, const char *name, const char *version)
{
	cgpu_dlsym_fn real = cgpu_real_dlsym();
	cgpu_dlvsym_fn realv = cgpu_real_dlvsym();
	void *h = dlopen(obj_name[0] ? obj_name : NULL, RTLD_LAZY | RTLD_NOLOAD), *r = NULL;

	if (h && version && realv)
		r = realv(h, name, version);
	else if (h && !version && real)
		r = real(h, name);
	if (h)
		dlclose(h);
	return r;
}

CGPU_NO_ASAN void *cgpu_dlsym_next(const void *caller, const char *name, const char *version)
{
	struct next_search s = {
		.caller = caller, .name = name, .version = version,
		.vdso = (const void *)(uintptr_t)getauxval(AT_SYSINFO_EHDR),
	};
	unsigned type;

	if (!name || !dl_iterate_phdr(next_cb, &s))
		return NULL;
	type = ELF64_ST_TYPE(s.sym->st_info);
#if defined(__x86_64__) || defined(__i386__)
	/* x86 resolvers take no arguments (glibc's elf_ifunc_invoke). Calling it
	 * here avoids dlopen, which under ASan is an interceptor not wired up yet
	 * when the runtime asks us for strlen & co. */
	if (type == STT_GNU_IFUNC)
		return ((void *(*)(void))sym_addr(&s.obj, s.sym))();
#endif
	if (type == STT_GNU_IFUNC || type == STT_TLS)
		return via_handle(s.obj_name, name, version);
	return (void *)sym_addr(&s.obj, s.sym);
}
