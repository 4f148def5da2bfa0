/* The decisions of the time-slice scheduler. Two kinds of account per tenant:
 *
 * - budget_ns, for the reserving policies (fair, fixed): what the tenant may
 *   still use in the current period. Refilled at each period boundary; what is
 *   left is lost (a reservation is "exactly this much, never more"; see
 *   refill() for the one exception), what was overdrawn is carried as debt, so
 *   an overrunning kernel is paid back. Under fair, time that no tenant may
 *   use by its budget is lent (see lend()); a lent slice is not charged to
 *   the budget, so borrowing neither creates debt nor eats a reservation the
 *   borrower still has for later in the period.
 * - lag_ns, for ordering and for the work-conserving policies (preemptive,
 *   weighted, soft): device time owed to the tenant. Each charge hands the used
 *   time out to the tenants that wanted the GPU in proportion to their weights
 *   and takes it from the one that used it (the same bookkeeping as
 *   weighted fair queueing, kept in nanoseconds of service rather than virtual
 *   time so weights and the set of tenants can change without rescaling).
 *   Only tenants with work accrue, so idle share is lent without creating debt.
 *
 * What a tenant is owed (positive lag, leftover budget) is clamped to one
 * period, so no history can make it starve the others for longer. What it
 * owes is clamped to MAX_DEBT_PERIODS periods: a kernel longer than a period
 * cannot be cut short by any gate, and is paid back in full by the periods
 * after it instead of being forgiven past the first. */
#include "scheduler.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(CGPU_SCHED_ENOENT == -ENOENT, "status codes are errno values");
_Static_assert(CGPU_SCHED_ENODEV == -ENODEV, "status codes are errno values");
_Static_assert(CGPU_SCHED_EINVAL == -EINVAL, "status codes are errno values");
_Static_assert(CGPU_SCHED_ENOSPC == -ENOSPC, "status codes are errno values");
_Static_assert(CGPU_SCHED_EDQUOT == -EDQUOT, "status codes are errno values");

/* Charges above this are clamped: far beyond any lag bound, and small enough
 * that charge * weight cannot overflow int64. */
#define MAX_CHARGE_NS ((uint64_t)1 << 40)
/* Shares are weights of share * SHARE_SCALE so that a memory-only tenant's part
 * of the unreserved remainder stays a nonzero integer. */
#define SHARE_SCALE 32u
/* More skipped periods than this refill like this many: enough to clear any
 * debt, small enough that k * quota cannot overflow. */
#define MAX_REFILL_PERIODS ((uint64_t)1 << 20)

struct tenant {
    uint64_t key;
    unsigned share;
    unsigned weight;
    int high;
    int demand;
    uint64_t charged;
    int64_t lag;
    int64_t budget;
    int64_t quota;
    uint64_t last_pick; /* decision sequence number; breaks ties round-robin */
    uint64_t lent;      /* what is left of its last grant's lent slice, uncharged */
    uint64_t quiet_from; /* when its demand last went away; set once quieted */
    int quieted;
};

struct gpu {
    int policy;
    uint64_t period;
    uint64_t max_slice;
    unsigned hp_percent;

    int period_valid;
    uint64_t period_start;
    uint64_t now;          /* of the last decision: where in the period a change lands */
    uint64_t seq;

    unsigned n;
    unsigned reserved;     /* sum of shares */
    unsigned memory_only;  /* tenants with share 0 */
    struct tenant t[CGPU_SCHED_MAX_TENANTS];

    int64_t pool_budget; /* fixed: the unreserved remainder, for memory-only tenants */
    int64_t pool_quota;
    int64_t hp_budget;   /* high-priority precedence left in this period */
    int64_t hp_quota;
    /* The GPU idled this period because debtors waited (debtor_wait), and
     * since when it idles for that now (idling_for_debtor). */
    uint64_t debtor_idle;
    uint64_t debtor_idle_from;
    int idling_for_debtor;
    int debtor_skipped; /* this decision passed a debtor over */
};

struct cgpu_sched {
    unsigned gpu_count;
    struct gpu g[CGPU_SCHED_MAX_GPUS];
};

static int64_t clamp64(int64_t v, int64_t lo, int64_t hi)
{
    return v < lo ? lo : v > hi ? hi : v;
}

static uint64_t max_u64(uint64_t a, uint64_t b)
{
    return a > b ? a : b;
}

static uint64_t min_u64(uint64_t a, uint64_t b)
{
    return a < b ? a : b;
}

static int reserving(const struct gpu *g)
{
    return g->policy == CGPU_SCHED_FAIR || g->policy == CGPU_SCHED_FIXED;
}

static int64_t bound(const struct gpu *g)
{
    return (int64_t)g->period;
}

/* Debt (negative lag or budget) may reach this many periods. */
#define MAX_DEBT_PERIODS 16

static int64_t debt_bound(const struct gpu *g)
{
    return MAX_DEBT_PERIODS * (int64_t)g->period;
}

static uint64_t weight_of(const struct gpu *g, const struct tenant *t)
{
    switch (g->policy) {
    case CGPU_SCHED_WEIGHTED:
        return t->weight;
    case CGPU_SCHED_FIXED:
    case CGPU_SCHED_SOFT:
        if (t->share)
            return (uint64_t)t->share * SHARE_SCALE;
        /* Memory-only tenants split the unreserved remainder. With nothing
         * unreserved they get a token weight rather than zero: the charge
         * arithmetic divides by the sum, and they still run when the
         * reserving tenants leave the GPU idle. */
        {
            uint64_t w = (uint64_t)(100u - g->reserved) * SHARE_SCALE / g->memory_only;
            return w ? w : 1;
        }
    default:
        return 1;
    }
}

static int64_t quota_of(const struct gpu *g, const struct tenant *t)
{
    if (g->policy == CGPU_SCHED_FAIR)
        return (int64_t)(g->period / g->n);
    if (g->policy == CGPU_SCHED_FIXED)
        return (int64_t)(g->period * t->share / 100u);
    return 0;
}

/* A quota change takes effect for the rest of the current period (`left` of
 * `period`), but never turns time already used under the old quota into
 * debt. Pro rata: a share raised as the period ends is not a whole extra
 * quota to run, or to carry into the next period. */
static int64_t requota(int64_t budget, int64_t old_quota, int64_t new_quota, uint64_t left, uint64_t period)
{
    if (new_quota == old_quota)
        return budget; /* keeps a carried leftover, which may exceed the quota */
    int64_t floor = budget < 0 ? budget : 0;
    /* |difference| <= period <= 2^30 and left <= period: no overflow. */
    int64_t b = budget + (new_quota - old_quota) * (int64_t)left / (int64_t)period;
    if (b > new_quota)
        b = new_quota;
    return b < floor ? floor : b;
}

static void update_quotas(struct gpu *g)
{
    uint64_t into = g->now > g->period_start ? g->now - g->period_start : 0;
    uint64_t left = g->period - min_u64(into, g->period);
    for (unsigned i = 0; i < g->n; i++) {
        struct tenant *t = &g->t[i];
        int64_t q = quota_of(g, t);
        if (g->period_valid)
            t->budget = requota(t->budget, t->quota, q, left, g->period);
        t->quota = q;
    }
    int64_t pool = g->policy == CGPU_SCHED_FIXED ? (int64_t)(g->period * (100u - g->reserved) / 100u) : 0;
    int64_t hp = (int64_t)(g->period * g->hp_percent / 100u);
    if (g->period_valid) {
        g->pool_budget = requota(g->pool_budget, g->pool_quota, pool, left, g->period);
        g->hp_budget = requota(g->hp_budget, g->hp_quota, hp, left, g->period);
    }
    g->pool_quota = pool;
    g->hp_quota = hp;
}

/* Debt is carried and k periods pay k quotas of it. Leftover is lost, except
 * that a tenant still waiting with work at the boundary keeps up to two
 * slices of it: it was shut out by other tenants' overruns filling the
 * period, and dropping its turn would hand their overrun to it. Two, because
 * an overrunner pays its debt by skipping a period only every few periods
 * while its victims lose a little in each. Only one boundary's worth
 * carries, so no tenant can bank share. */
static int64_t refill(int64_t budget, int64_t quota, uint64_t k, int64_t carry)
{
    if (budget > 0) {
        int64_t kept = k == 1 ? (budget < carry ? budget : carry) : 0;
        return kept + quota;
    }
    int64_t b = budget + (int64_t)min_u64(k, MAX_REFILL_PERIODS) * quota;
    return b > quota ? quota : b;
}

static void refill_all(struct gpu *g, uint64_t k)
{
    int64_t carry = 2 * (int64_t)g->max_slice;
    int memory_only_waiting = 0;
    for (unsigned i = 0; i < g->n; i++) {
        struct tenant *t = &g->t[i];
        t->budget = refill(t->budget, t->quota, k, t->demand ? carry : 0);
        memory_only_waiting |= t->demand && t->share == 0;
    }
    g->pool_budget = refill(g->pool_budget, g->pool_quota, k, memory_only_waiting ? carry : 0);
    /* Precedence is not a reservation: none of it carries. */
    g->hp_budget = refill(g->hp_budget, g->hp_quota, k, 0);
    g->debtor_idle = 0;
}

static void advance_period(struct gpu *g, uint64_t now)
{
    /* The first decision starts the first period; a clock that went backwards
     * (a caller bug) restarts it rather than stalling until it catches up. */
    if (!g->period_valid || now < g->period_start) {
        g->period_valid = 1;
        g->period_start = now;
        refill_all(g, 1);
        return;
    }
    uint64_t k = (now - g->period_start) / g->period;
    if (k) {
        g->period_start += k * g->period; /* k * period <= now - period_start */
        refill_all(g, k);
    }
}

static void reset_accounts(struct gpu *g)
{
    g->period_valid = 0;
    g->period_start = 0;
    for (unsigned i = 0; i < g->n; i++) {
        g->t[i].lag = 0;
        g->t[i].budget = 0;
        g->t[i].lent = 0;
    }
    g->pool_budget = 0;
    g->hp_budget = 0;
    g->debtor_idle = 0;
    g->idling_for_debtor = 0;
    update_quotas(g);
}

static void gpu_init(struct gpu *g)
{
    memset(g, 0, sizeof(*g));
    g->policy = CGPU_SCHED_NATIVE;
    g->period = CGPU_SCHED_DEFAULT_PERIOD_NS;
    g->max_slice = CGPU_SCHED_DEFAULT_SLICE_NS;
}

static struct gpu *gpu_at(struct cgpu_sched *s, unsigned gpu, int *rc)
{
    if (!s) {
        *rc = CGPU_SCHED_EINVAL;
        return NULL;
    }
    if (gpu >= s->gpu_count) {
        *rc = CGPU_SCHED_ENODEV;
        return NULL;
    }
    return &s->g[gpu];
}

static int find(const struct gpu *g, uint64_t key)
{
    for (unsigned i = 0; i < g->n; i++)
        if (g->t[i].key == key)
            return (int)i;
    return -1;
}

static struct tenant *tenant_at(struct cgpu_sched *s, unsigned gpu, uint64_t key, struct gpu **gp, int *rc)
{
    struct gpu *g = gpu_at(s, gpu, rc);
    if (!g)
        return NULL;
    if (key == 0) {
        *rc = CGPU_SCHED_EINVAL;
        return NULL;
    }
    int i = find(g, key);
    if (i < 0) {
        *rc = CGPU_SCHED_ENOENT;
        return NULL;
    }
    *gp = g;
    return &g->t[i];
}

int cgpu_sched_abi_version(void)
{
    return CGPU_SCHED_ABI_VERSION;
}

struct cgpu_sched *cgpu_sched_create(unsigned gpu_count)
{
    if (gpu_count == 0 || gpu_count > CGPU_SCHED_MAX_GPUS)
        return NULL;
    struct cgpu_sched *s = calloc(1, sizeof(*s));
    if (!s)
        return NULL;
    s->gpu_count = gpu_count;
    for (unsigned i = 0; i < gpu_count; i++)
        gpu_init(&s->g[i]);
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

int cgpu_sched_configure(struct cgpu_sched *s, unsigned gpu, int policy, uint64_t period_ns,
                         uint64_t max_slice_ns, unsigned high_prio_percent)
{
    int rc = 0;
    struct gpu *g = gpu_at(s, gpu, &rc);
    if (!g)
        return rc;
    if (policy < CGPU_SCHED_FAIR || policy > CGPU_SCHED_NATIVE)
        return CGPU_SCHED_EINVAL;
    if (period_ns < CGPU_SCHED_MIN_PERIOD_NS || period_ns > CGPU_SCHED_MAX_PERIOD_NS)
        return CGPU_SCHED_EINVAL;
    if (max_slice_ns < CGPU_SCHED_MIN_SLICE_NS || max_slice_ns > period_ns)
        return CGPU_SCHED_EINVAL;
    if (policy == CGPU_SCHED_SOFT && max_slice_ns > CGPU_SCHED_SOFT_MAX_SLICE_NS)
        return CGPU_SCHED_EINVAL;
    if (high_prio_percent > 100)
        return CGPU_SCHED_EINVAL;
    g->policy = policy;
    g->period = period_ns;
    g->max_slice = max_slice_ns;
    g->hp_percent = high_prio_percent;
    reset_accounts(g);
    return CGPU_SCHED_OK;
}

int cgpu_sched_config_get(const struct cgpu_sched *s, unsigned gpu, struct cgpu_sched_config *out)
{
    int rc = 0;
    const struct gpu *g = gpu_at((struct cgpu_sched *)s, gpu, &rc);
    if (!g)
        return rc;
    if (!out)
        return CGPU_SCHED_EINVAL;
    out->policy = g->policy;
    out->period_ns = g->period;
    out->max_slice_ns = g->max_slice;
    out->high_prio_percent = g->hp_percent;
    return CGPU_SCHED_OK;
}

int cgpu_sched_tenant_set(struct cgpu_sched *s, unsigned gpu, uint64_t key, unsigned share_percent,
                          unsigned weight, int high_priority)
{
    int rc = 0;
    struct gpu *g = gpu_at(s, gpu, &rc);
    if (!g)
        return rc;
    if (key == 0 || share_percent > 100 || weight < 1 || weight > 100)
        return CGPU_SCHED_EINVAL;
    int i = find(g, key);
    unsigned old_share = i >= 0 ? g->t[i].share : 0;
    if (g->reserved - old_share + share_percent > 100)
        return CGPU_SCHED_EDQUOT;
    if (i < 0) {
        if (g->n == CGPU_SCHED_MAX_TENANTS)
            return CGPU_SCHED_ENOSPC;
        i = (int)g->n++;
        memset(&g->t[i], 0, sizeof(g->t[i]));
        g->t[i].key = key;
        /* A newcomer starts level with the others: no credit, no debt. Its
         * budget is filled when the quotas are recomputed below. */
    } else if (old_share == 0) {
        g->memory_only--;
    }
    struct tenant *t = &g->t[i];
    g->reserved = g->reserved - old_share + share_percent;
    if (share_percent == 0)
        g->memory_only++;
    t->share = share_percent;
    t->weight = weight;
    t->high = high_priority != 0;
    update_quotas(g);
    return CGPU_SCHED_OK;
}

int cgpu_sched_tenant_remove(struct cgpu_sched *s, unsigned gpu, uint64_t key)
{
    int rc = 0;
    struct gpu *g = NULL;
    struct tenant *t = tenant_at(s, gpu, key, &g, &rc);
    if (!t)
        return rc;
    unsigned i = (unsigned)(t - g->t);
    g->reserved -= t->share;
    if (t->share == 0)
        g->memory_only--;
    /* Keep the order: ties are broken by it, and decisions stay reproducible. */
    memmove(&g->t[i], &g->t[i + 1], (g->n - i - 1) * sizeof(g->t[0]));
    g->n--;
    update_quotas(g);
    return CGPU_SCHED_OK;
}

int cgpu_sched_tenant_count(const struct cgpu_sched *s, unsigned gpu)
{
    int rc = 0;
    const struct gpu *g = gpu_at((struct cgpu_sched *)s, gpu, &rc);
    return g ? (int)g->n : rc;
}

int cgpu_sched_tenant_get(const struct cgpu_sched *s, unsigned gpu, uint64_t key,
                          struct cgpu_sched_tenant_info *out)
{
    int rc = 0;
    struct gpu *g = NULL;
    const struct tenant *t = tenant_at((struct cgpu_sched *)s, gpu, key, &g, &rc);
    if (!t)
        return rc;
    if (!out)
        return CGPU_SCHED_EINVAL;
    out->key = t->key;
    out->share_percent = t->share;
    out->weight = t->weight;
    out->high_priority = t->high;
    out->has_work = t->demand;
    out->charged_ns = t->charged;
    out->lag_ns = t->lag;
    out->budget_ns = t->budget;
    return CGPU_SCHED_OK;
}

int cgpu_sched_demand(struct cgpu_sched *s, unsigned gpu, uint64_t key, int has_work, uint64_t now_ns)
{
    int rc = 0;
    struct gpu *g = NULL;
    struct tenant *t = tenant_at(s, gpu, key, &g, &rc);
    if (!t)
        return rc;
    /* Credit earned while waiting is not kept across an idle spell: a tenant
     * that comes back from one starts level (soft reclaims promptly, but
     * cannot bank share by idling). A gap shorter than a period is no idle
     * spell: its threads were late back to the gate (a loaded CPU), and
     * wiping the credit then would forgive whoever ran meanwhile. Debt is
     * kept, or idling would launder an overrun. */
    if (!has_work && t->demand) {
        t->quiet_from = now_ns;
        t->quieted = 1;
    } else if (has_work && !t->demand && t->lag > 0 && now_ns - t->quiet_from >= g->period)
        t->lag = 0;
    t->demand = has_work != 0;
    return CGPU_SCHED_OK;
}

/* Can the tenant be given a slice now? Reserving policies also need budget. */
static int eligible(const struct gpu *g, const struct tenant *t)
{
    if (!t->demand)
        return 0;
    if (g->policy == CGPU_SCHED_FAIR)
        return t->budget > 0;
    if (g->policy == CGPU_SCHED_FIXED)
        return t->share ? t->budget > 0 : g->pool_budget > 0;
    return 1;
}

int cgpu_sched_charge(struct cgpu_sched *s, unsigned gpu, uint64_t key, uint64_t busy_ns)
{
    int rc = 0;
    struct gpu *g = NULL;
    struct tenant *t = tenant_at(s, gpu, key, &g, &rc);
    if (!t)
        return rc;
    uint64_t b = min_u64(busy_ns, MAX_CHARGE_NS);
    t->charged = t->charged > UINT64_MAX - busy_ns ? UINT64_MAX : t->charged + busy_ns;
    if (g->policy == CGPU_SCHED_NATIVE)
        return CGPU_SCHED_OK;

    /* The time goes to those that wanted the GPU while it was used: tenants
     * with work (and, under fixed, budget to use) plus the user. Under fair a
     * tenant without budget still wants the lent time, which goes by lag. */
    unsigned char part[CGPU_SCHED_MAX_TENANTS];
    uint64_t total = 0;
    for (unsigned i = 0; i < g->n; i++) {
        part[i] = &g->t[i] == t || (g->policy == CGPU_SCHED_FAIR ? g->t[i].demand : eligible(g, &g->t[i]));
        if (part[i])
            total += weight_of(g, &g->t[i]);
    }
    const int64_t lim = bound(g);
    for (unsigned i = 0; i < g->n; i++) {
        if (!part[i])
            continue;
        struct tenant *u = &g->t[i];
        /* b <= 2^40, weight <= 3200 and total >= weight: no overflow. */
        int64_t lag = u->lag + (int64_t)(b * weight_of(g, u) / total);
        if (u == t)
            lag -= (int64_t)b;
        u->lag = clamp64(lag, -debt_bound(g), lim);
    }

    /* Lent time is borrowed, not the tenant's own: only what outlasts the
     * lent slice (a kernel that overran it) is, and becomes debt like any
     * overrun. A charge arrives before the next decision, so `lent` still
     * describes the grant being charged. */
    uint64_t lent = min_u64(b, t->lent);
    t->lent -= lent;
    b -= lent;
    if (g->policy == CGPU_SCHED_FIXED && t->share == 0)
        g->pool_budget = clamp64(g->pool_budget - (int64_t)b, -debt_bound(g), lim);
    else if (reserving(g))
        t->budget = clamp64(t->budget - (int64_t)b, -debt_bound(g), lim);
    if (t->high)
        g->hp_budget = clamp64(g->hp_budget - (int64_t)(b + lent), -lim, lim);
    return CGPU_SCHED_OK;
}

/* A reservation is paced: a tenant is given a slice only while what it has
 * left is at least its quota's part of what is left of the period, less a
 * quarter slice. A 30 % tenant alone so gets its 30 % in slices spread over
 * the period, not all at once (no 70 ms stall per period for its latency); a
 * tenant that joins at any moment finds the others' use spread evenly; one
 * that joins mid-period (and got a pro-rata budget) runs at its rate from
 * then on. The quarter slice keeps a tenant that runs right at its pace from
 * being stopped for microseconds at slice ends. Returns 0 when on pace, else
 * when (after the period's start) it will be. */
static uint64_t pace_wait(const struct gpu *g, const struct tenant *t, uint64_t elapsed)
{
    int pool = g->policy == CGPU_SCHED_FIXED && t->share == 0;
    int64_t budget = pool ? g->pool_budget : t->budget;
    int64_t quota = pool ? g->pool_quota : t->quota;
    if (!reserving(g) || budget <= 0 || quota <= 0)
        return 0;
    /* budget <= a period and two slices < 2^32, period and quota <= 2^30:
     * every product < 2^62. */
    uint64_t have = (uint64_t)budget + g->max_slice / 4;
    if (have * g->period >= (uint64_t)quota * (g->period - elapsed))
        return 0;
    return g->period - have * g->period / (uint64_t)quota;
}

/* A tenant that owes more than a period (a kernel that ran on long past its
 * turn; by lag, or by budget under fair) is not given the GPU in a moment's
 * gap: while another tenant's demand went away less than a slice ago (its
 * threads late back to the gate on a loaded CPU) the GPU waits for that
 * one, or every such gap would hand the debtor its next long kernel and the
 * debt, clamped, would never be paid. The GPU idles for this at most a
 * slice a period: beside a tenant whose work really comes in short bursts
 * the debtor is not repaid by waiting, and would be held to a fraction of
 * its share while the GPU idled. Only for time nobody reserved (the
 * work-conserving policies, fair's loans). Returns 0 when it may run, else
 * when (after the period's start) it may, and then marks the decision as
 * having passed a debtor over (debtor_skipped), so its idle time counts. */
static uint64_t debtor_wait(struct gpu *g, const struct tenant *t, uint64_t elapsed)
{
    if ((reserving(g) ? t->budget : t->lag) >= -bound(g) || g->debtor_idle >= g->max_slice)
        return 0;
    uint64_t left = 0;
    for (unsigned i = 0; i < g->n; i++) {
        const struct tenant *u = &g->t[i];
        if (u != t && !u->demand && u->quieted && u->quiet_from <= g->now && g->now - u->quiet_from < g->max_slice)
            left = max_u64(left, g->max_slice - (g->now - u->quiet_from));
    }
    if (!left)
        return 0;
    g->debtor_skipped = 1;
    return elapsed + min_u64(left, g->max_slice - g->debtor_idle);
}

/* The most owed eligible tenant on pace; among equals the one served
 * longest ago. *next: the earliest a tenant held back by its pace (or as a
 * debtor) is due. */
static struct tenant *pick(struct gpu *g, int high_only, uint64_t elapsed, uint64_t *next)
{
    struct tenant *best = NULL;
    for (unsigned i = 0; i < g->n; i++) {
        struct tenant *t = &g->t[i];
        if ((high_only && !t->high) || !eligible(g, t))
            continue;
        uint64_t due = pace_wait(g, t, elapsed);
        if (!due && !reserving(g))
            due = debtor_wait(g, t, elapsed);
        if (due) {
            *next = min_u64(*next, due);
            continue;
        }
        if (!best || t->lag > best->lag || (t->lag == best->lag && t->last_pick < best->last_pick))
            best = t;
    }
    return best;
}

/* Under fair, when no tenant may run by its budget and pace: the most owed
 * tenant with work, whatever its budget (two busy tenants beside an idle one
 * split its time equally, by lag, as under preemptive). */
static struct tenant *lend(struct gpu *g, uint64_t elapsed, uint64_t *next)
{
    struct tenant *best = NULL;
    for (unsigned i = 0; i < g->n; i++) {
        struct tenant *t = &g->t[i];
        if (!t->demand)
            continue;
        uint64_t due = debtor_wait(g, t, elapsed);
        if (due) {
            *next = min_u64(*next, due);
            continue;
        }
        if (!best || t->lag > best->lag || (t->lag == best->lag && t->last_pick < best->last_pick))
            best = t;
    }
    return best;
}

/* When (since the period's start) the first tenant other than `t` that is
 * held back by its pace is due; the period's end if none is. */
static uint64_t due_of_others(const struct gpu *g, const struct tenant *t, uint64_t elapsed)
{
    uint64_t due = g->period;
    for (unsigned i = 0; i < g->n; i++) {
        const struct tenant *u = &g->t[i];
        if (u != t && eligible(g, u))
            due = min_u64(due, pace_wait(g, u, elapsed) ? pace_wait(g, u, elapsed) : due);
    }
    return due;
}

int cgpu_sched_next(struct cgpu_sched *s, unsigned gpu, uint64_t now_ns, struct cgpu_sched_decision *out)
{
    int rc = 0;
    struct gpu *g = gpu_at(s, gpu, &rc);
    if (!g)
        return rc;
    if (!out)
        return CGPU_SCHED_EINVAL;
    if (g->policy == CGPU_SCHED_NATIVE) {
        out->key = 0;
        out->slice_ns = 0;
        return CGPU_SCHED_UNGATED;
    }
    if (g->idling_for_debtor && now_ns > g->debtor_idle_from)
        g->debtor_idle += now_ns - g->debtor_idle_from;
    g->idling_for_debtor = 0;
    g->debtor_skipped = 0;
    advance_period(g, now_ns);
    g->now = now_ns;
    /* now_ns - period_start < period, so this is >= 1. */
    uint64_t elapsed = now_ns - g->period_start;
    uint64_t to_period_end = g->period - elapsed;
    uint64_t due = g->period;

    /* High-priority tenants go first while this period's precedence lasts. */
    int hp_phase = g->hp_budget > 0;
    struct tenant *t = hp_phase ? pick(g, 1, elapsed, &due) : NULL;
    if (!t) {
        hp_phase = 0;
        t = pick(g, 0, elapsed, &due);
    }
    /* Fair keeps every tenant's entitlement, not the device: time nobody may
     * use by budget and pace is lent, up to the moment a tenant holding back
     * for its pace is due (or the period ends, which refills), so lending
     * delays no reservation beyond the slice a returning tenant waits for
     * anyway. A shorter loan than the shortest slice costs more than it
     * gives. */
    uint64_t loan = 0, ahead = 0;
    struct tenant *borrower = !t && g->policy == CGPU_SCHED_FAIR ? lend(g, elapsed, &due) : NULL;
    if (borrower) {
        uint64_t until = due_of_others(g, borrower, elapsed);
        if (until - elapsed >= CGPU_SCHED_MIN_SLICE_NS) {
            t = borrower;
            /* One held back only by its own pace runs on its budget, ahead
             * of pace, rather than on loans ending at its own due time: those
             * would be microseconds long, turning the caller's loop as often. */
            if (borrower->budget > 0)
                ahead = until - elapsed;
            else
                loan = min_u64(g->max_slice, until - elapsed);
        }
    }
    if (!t) {
        /* Nobody may run until a paced tenant is due or the next refill (or
         * until someone reports work, when the caller asks again). */
        if (g->debtor_skipped) {
            g->idling_for_debtor = 1;
            g->debtor_idle_from = now_ns;
        }
        out->key = 0;
        out->slice_ns = due - elapsed;
        return CGPU_SCHED_OK;
    }

    uint64_t slice = g->max_slice;
    if (loan) {
        slice = loan; /* <= to_period_end: due <= period */
    } else if (reserving(g)) {
        /* Budgets are per period: a slice ends with the period, so a
         * reservation is honoured in every period, not just on average. */
        slice = min_u64(slice, to_period_end);
        int64_t left = (g->policy == CGPU_SCHED_FIXED && t->share == 0) ? g->pool_budget : t->budget;
        slice = min_u64(slice, (uint64_t)left);
        if (ahead)
            slice = min_u64(slice, ahead);
    }
    if (hp_phase) {
        slice = min_u64(slice, (uint64_t)g->hp_budget);
    } else if (g->hp_quota > 0) {
        /* A high-priority tenant that is waiting for the refill gets the GPU
         * as the period turns, not a slice later. */
        for (unsigned i = 0; i < g->n; i++)
            if (g->t[i].high && g->t[i].demand) {
                slice = min_u64(slice, to_period_end);
                break;
            }
    }
    t->last_pick = ++g->seq;
    t->lent = loan ? slice : 0;
    out->key = t->key;
    out->slice_ns = slice;
    return CGPU_SCHED_OK;
}
