/* The instance region: the one contract between cgpud (writes it), libcgpu.so
 * (enforces it inside the container) and the compute scheduler. Three files in
 * one directory:
 *
 *   limits  written by cgpud, mounted read-only: what the instance may use
 *           (read once by each process; a resize also stores the new memory
 *           limit in grants, where running processes read it)
 *   usage   shared, writable: what its processes use now, one ledger per process
 *   grants  written by cgpud, read-only to the instance: whether it may launch
 *           work on each device now, and each device's live memory limit
 *
 * Versioned binary layout with magic numbers; C reads it directly, Python
 * through cffi from this same header (csrc/region/build_region.py).
 *
 * Ownership: cgpud creates all three files; every process of the instance
 * maps them. Thread-safety: limits never change after publication (cgpud replaces
 * the file atomically); every usage field is an atomic; charging takes no
 * lock. A process ledger is kept alive by an OFD byte-range lock at
 * CGPU_LEDGER_LOCK_OFFSET, which the kernel drops when the process dies;
 * claims take turns on one more lock byte. */
#ifndef CGPU_REGION_H
#define CGPU_REGION_H

#include <stdint.h>

#ifndef CGPU_ATOMIC
#define CGPU_ATOMIC _Atomic
#endif

#define CGPU_LIMITS_MAGIC 0x53544d494c555047ULL /* "GPULIMTS" */
#define CGPU_USAGE_MAGIC 0x4547415355555047ULL  /* "GPUUSAGE" */
#define CGPU_GRANTS_MAGIC 0x544e415247555047ULL /* "GPUGRANT" */
#define CGPU_REGION_VERSION 2
#define CGPU_MAX_DEVICES 16
#define CGPU_MAX_PROCS 1024
#define CGPU_UUID_LEN 96 /* NVML_DEVICE_UUID_V2_BUFFER_SIZE */
#define CGPU_INSTANCE_ID_LEN 64

/* Inside a container the region is always here; the environment cannot move
 * it. Host processes started by `cgpuctl run` name theirs in CGPU_REGION_DIR. */
#define CGPU_REGION_FIXED_DIR "/run/cgpu"
#define CGPU_REGION_ENV "CGPU_REGION_DIR"
#define CGPU_LIMITS_FILE "limits"
#define CGPU_USAGE_FILE "usage"
#define CGPU_GRANTS_FILE "grants"
/* Can only make the library louder than the region's log_level. */
#define CGPU_LOG_ENV "CGPU_LOG_LEVEL"

enum cgpu_log_level { CGPU_LOG_QUIET = 0, CGPU_LOG_ERROR = 1, CGPU_LOG_INFO = 2, CGPU_LOG_DEBUG = 3 };

struct cgpu_device_limit {
    char uuid[CGPU_UUID_LEN];     /* "GPU-..." as NVML prints it: identity, never an index */
    uint64_t mem_limit;           /* bytes the instance may hold on this GPU */
    uint32_t host_index;          /* NVML index on the host, for messages only */
    uint32_t core_percent;        /* compute share 1-100; 0 = no compute limit */
    uint32_t weight;              /* compute: weighted policies */
    uint32_t priority;            /* compute: high-priority instances */
};

struct cgpu_limits {
    uint64_t magic;               /* CGPU_LIMITS_MAGIC */
    uint32_t version;             /* CGPU_REGION_VERSION */
    uint32_t size;                /* sizeof(struct cgpu_limits) */
    char instance_id[CGPU_INSTANCE_ID_LEN];
    uint32_t device_count;
    uint32_t log_level;           /* enum cgpu_log_level */
    uint32_t compute_policy;      /* cgpud writes the node's ComputePolicy; nothing reads it
                                   * (the scheduler gets policy from cgpud): kept for the layout */
    uint32_t reserved;            /* padding: device[] starts 8-byte aligned */
    struct cgpu_device_limit device[CGPU_MAX_DEVICES];
    uint64_t checksum;            /* cgpu_region_checksum() of every byte before it */
};

struct cgpu_device_usage {
    CGPU_ATOMIC uint64_t used;    /* bytes held by all processes of the instance */
    CGPU_ATOMIC uint32_t waiting; /* threads blocked at a closed gate: the instance's demand */
    CGPU_ATOMIC uint32_t bell;    /* futex word: bumped and woken after each fence_ack */
    CGPU_ATOMIC uint64_t gated;   /* launches that found the gate closed and waited (metrics only;
                                   * tenant-written, so never trusted for a decision) */
    CGPU_ATOMIC uint64_t paced_ns; /* device time its launches took while paced in their window, as
                                    * its processes measure it at each drain (metrics only, as gated) */
    uint64_t reserved[4];         /* one cache line per device */
};

enum cgpu_ledger_state { CGPU_LEDGER_FREE = 0, CGPU_LEDGER_CLAIMING = 1, CGPU_LEDGER_LIVE = 2 };

struct cgpu_proc_ledger {
    CGPU_ATOMIC uint32_t state;   /* enum cgpu_ledger_state */
    CGPU_ATOMIC int32_t pid;      /* as the process sees itself */
    CGPU_ATOMIC uint64_t used[CGPU_MAX_DEVICES];
    CGPU_ATOMIC uint32_t watching; /* bit per device: this process launches gated work there */
    uint32_t reserved;
    /* Per device: the gate sequence (CGPU_GATE_SEQ_MASK bits) whose revocation
     * this process has fenced, | CGPU_ACK_LAUNCHED if it launched in that grant;
     * or, while a gate is open, its idle report for it (| CGPU_ACK_IDLE). */
    CGPU_ATOMIC uint32_t fence_ack[CGPU_MAX_DEVICES];
};

struct cgpu_usage {
    uint64_t magic;               /* CGPU_USAGE_MAGIC */
    uint32_t version;
    uint32_t size;                /* sizeof(struct cgpu_usage) */
    CGPU_ATOMIC uint32_t ledgers_used; /* ledgers at or past this index were never claimed */
    uint32_t reserved[15];
    struct cgpu_device_usage device[CGPU_MAX_DEVICES];
    struct cgpu_proc_ledger proc[CGPU_MAX_PROCS];
};

/* ---- grants: the compute scheduler's side ----------------------------------
 *
 * One gate word per device of the instance, a futex word on a shared file
 * mapping. Protocol:
 *   - cgpud opens the gate (new sequence | CGPU_GATE_OPEN) for the instance
 *     that holds the device and closes it (new sequence, no OPEN) at the end of
 *     its slice; every change adds CGPU_GATE_SEQ_STEP and is followed by a
 *     FUTEX_WAKE of all waiters. CGPU_GATE_UNGATED means no compute control:
 *     launch freely, never fence.
 *   - A thread that wants to launch while the gate is closed counts itself in
 *     usage.device[d].waiting and FUTEX_WAITs on the gate.
 *   - A process that launched gated work on device d sets bit d of its
 *     ledger's `watching`; when the gate closes it waits for its own work in
 *     flight to finish (real driver synchronisation), then stores the closed
 *     gate's sequence in fence_ack[d], bumps usage.device[d].bell and wakes it.
 *   - cgpud charges the holder from the grant until every live watching
 *     process has acknowledged (the device time it really used), then grants
 *     the next instance.
 *   - While the gate is open with sequence S, a process with nothing in flight
 *     may store S | CGPU_ACK_IDLE in fence_ack[d] (never over the
 *     acknowledgement of a closing after S), | CGPU_ACK_DRAINED when its whole
 *     queue is known empty; it bumps the bell (and wakes it, at most once a
 *     ms). Its next launch first puts the old value back, then reads the gate.
 *     When every live watching process of the holder reports S idle for a
 *     short grace and another instance waits, cgpud closes the gate early:
 *     the GPU is passed on, the holder's entitlement is not (it was charged
 *     only what it used). Reports that still stand, all DRAINED, once the
 *     gate is closed end the closing at once (no launch can have passed the
 *     gate since); otherwise it is fenced as any other.
 *   - While the gate is open with word W and probe == W (cgpud sets it when
 *     another instance waits, and wakes the gate's futex without changing
 *     it), a process that launched in the grant waits for its own queue in
 *     its watcher (every context it launched in) and reports the grant idle
 *     as above when nothing was in flight before and nothing launched since:
 *     so a holder is passed over however it waits for its work, or if it
 *     does not wait at all. */
#define CGPU_GATE_OPEN 1u
#define CGPU_GATE_UNGATED 2u
#define CGPU_GATE_SEQ_STEP 4u
#define CGPU_GATE_SEQ_MASK 0xfffffffcu
#define CGPU_ACK_LAUNCHED 1u
#define CGPU_ACK_IDLE 2u
#define CGPU_ACK_DRAINED 1u /* with CGPU_ACK_IDLE only */

struct cgpu_device_grant {
    CGPU_ATOMIC uint32_t gate;
    /* The open gate word while another instance waits for the device: the
     * holder's processes then look for their own idleness off the launch
     * path (a real synchronisation in their fence watcher) and report it as
     * below. Any other value (0 from an older cgpud): they need not. */
    CGPU_ATOMIC uint32_t probe;
    CGPU_ATOMIC uint64_t slice_end_ns; /* CLOCK_MONOTONIC; while OPEN: when the slice ends (informational) */
    CGPU_ATOMIC uint64_t mem_limit;    /* the live memory limit (a resize changes it in place);
                                        * 0: the limits file's, as regions of older cgpud */
    /* While cgpud is away (its lock free, CGPU_GRANTS_LOCK_OFFSET): the
     * instance may launch only in [alone_start_ns, alone_start_ns +
     * alone_len_ns) of every alone_period_ns of CLOCK_MONOTONIC, a window
     * cgpud tiles with its neighbours' so that fixed shares hold without
     * it. alone_period_ns 0: no window, launches run ungated (fail open). */
    CGPU_ATOMIC uint64_t alone_period_ns;
    CGPU_ATOMIC uint64_t alone_start_ns;
    CGPU_ATOMIC uint64_t alone_len_ns;
    /* A closed gate word (never 0) under which cgpud, while it runs, leaves
     * the instance to keep to its window by itself, as if away: the gate
     * equal to it means "pace in your window", any other value (0 from an
     * older cgpud) means nothing. Written before that gate word. */
    CGPU_ATOMIC uint32_t paced;
    uint32_t reserved32;
    uint64_t reserved[1];              /* one cache line per device */
};

struct cgpu_grants {
    uint64_t magic;               /* CGPU_GRANTS_MAGIC */
    uint32_t version;
    uint32_t size;                /* sizeof(struct cgpu_grants) */
    uint64_t reserved[6];
    struct cgpu_device_grant device[CGPU_MAX_DEVICES];
};

/* The lock bytes lie past the structure so nobody reads or writes them. */
#define CGPU_LEDGER_LOCK_OFFSET(i) ((long)sizeof(struct cgpu_usage) + (long)(i))
/* Claims of one instance take turns on the byte after the last ledger's
 * (csrc/region/region.c). */
/* cgpud's engine holds an OFD write lock on this byte of the grants file for
 * every device it drives; the kernel drops it when cgpud dies. A tenant that
 * finds it free (F_OFD_GETLK works on its read-only descriptor) knows that no
 * one will open its closed gate. */
#define CGPU_GRANTS_LOCK_OFFSET(slot) ((long)sizeof(struct cgpu_grants) + (long)(slot))

#endif
