/* Shared state of the simulated GPUs: one file mapped by every process that
 * uses the simulated driver, so that memory runs out and kernels contend
 * across processes as on a real host.
 *
 * Ownership: the file belongs to the machine (like the real GPUs); each process
 * owns one process slot while it lives. Thread-safety: every shared field is an
 * atomic; there is no lock. A process slot is kept alive by a byte-range OFD
 * lock that the kernel drops when the process dies, which is how others find
 * and reclaim the memory of a process killed with SIGKILL. */
#ifndef CGPU_SIMSTATE_H
#define CGPU_SIMSTATE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SIM_MAGIC 0x31305453554d4953ULL /* "SIMUST01" */
#define SIM_VERSION 4
#define SIM_MAX_GPUS 16
#define SIM_MAX_PROCS 512
#define SIM_RING 8192 /* execution records kept per GPU */
#define SIM_XID_RING 64 /* recent XIDs kept per GPU for NVML event sets */
#define SIM_XID_GPU_LOST 79 /* "GPU has fallen off the bus" */
#define SIM_NAME_LEN 96
#define SIM_UUID_LEN 80
#define SIM_BUSID_LEN 32

#define SIM_ENV_CONFIG "CGPU_SIM_CONFIG"
#define SIM_ENV_STATE "CGPU_SIM_STATE"
#define SIM_DEFAULT_STATE "/dev/shm/cgpu-sim-state"

struct sim_gpu_config {
    char name[SIM_NAME_LEN];
    char uuid[SIM_UUID_LEN];      /* "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" */
    char pci_bus_id[SIM_BUSID_LEN]; /* "00000000:18:00.0" as NVML prints it */
    uint64_t total_mem;           /* bytes */
    uint32_t sm_count;
    uint32_t cc_major, cc_minor;
    uint32_t pci_domain, pci_bus, pci_device, pci_device_id;
    uint32_t minor_number;
    uint32_t nvlink_peers;        /* bit i: an NVLink to GPU i */
    uint32_t reserved;            /* no padding: the config is hashed as bytes */
    /* Where the GPU sits in the PCIe tree, each an id + 1 (0: not behind one):
     * GPUs behind one switch are SINGLE apart, under one host bridge
     * HOSTBRIDGE, on one CPU socket NODE, else SYSTEM. */
    uint32_t pcie_switch, host_bridge, cpu_socket;
    uint32_t nvswitch_links;      /* links into the machine's NVSwitch fabric (after the direct ones) */
    /* MIG (simmig.h). A physical GPU: mig_mode 1 when enabled. A GPU
     * instance (an entry after the physical GPUs): its parent's index + 1
     * (0: a free entry), its profile (NVML index), instance ids (ci_id
     * SIM_MIG_NO_CI until it has a compute instance) and first memory
     * slice; mig_gen changes whenever the entry is taken or freed. NVML
     * changes these at run time: mig_mode, mig_parent, ci_id and mig_gen
     * are read and written atomically (simmig.h). */
    uint32_t mig_mode;
    uint32_t mig_parent;
    uint32_t mig_profile;
    uint32_t gi_id, ci_id;
    uint32_t gi_start;
    uint32_t mig_gen;
    uint32_t mig_reserved;
    uint8_t nvlink_links[SIM_MAX_GPUS]; /* links to GPU i, for i in nvlink_peers (1 if unset) */
};

struct sim_config {
    uint32_t gpu_count;
    uint32_t driver_version;      /* as cuDriverGetVersion: 13000 */
    char driver_version_str[32];  /* as nvmlSystemGetDriverVersion */
    uint32_t mig_count;           /* GPU instance entries: gpu[gpu_count .. gpu_count + mig_count), some free */
    uint32_t reserved;
    uint64_t queue_ns;            /* device time a stream may queue ahead */
    uint64_t default_kernel_ns;   /* cost of a kernel the simulation cannot time */
    uint64_t context_bytes;       /* driver memory of a process's first context on a GPU */
    struct sim_gpu_config gpu[SIM_MAX_GPUS];
};

/* One stretch of device time given to one process. Written once, then only
 * `end_ns` may grow (a process extending its own latest stretch). The
 * process is (slot, generation); pid and pidns name it after it is gone. */
struct sim_exec_record {
    _Atomic uint64_t seq;         /* index + 1 once published */
    _Atomic uint64_t start_ns;
    _Atomic uint64_t end_ns;
    _Atomic uint32_t slot;
    _Atomic int32_t pid;
    _Atomic uint64_t generation;
    _Atomic uint64_t pidns;
    /* Percent of the GPU's SMs the stretch had: 100, or an MPS client's
     * share of them while it ran beside others (sim_mps_share). */
    _Atomic uint32_t pct;
    uint32_t reserved;
};

/* One XID the GPU reported. Written once per use of its ring slot. */
struct sim_xid_record {
    _Atomic uint64_t seq;         /* index + 1 once published */
    _Atomic uint64_t xid;
};

/* Faults injected into a GPU (cgpu-sim-stat --xid, --lost, --recover): what
 * a real GPU's driver reports through NVML events and GPU_IS_LOST errors. */
struct sim_gpu_fault {
    _Atomic uint64_t xid_head;    /* XIDs ever reported */
    _Atomic uint32_t lost;        /* 1 while the GPU is off the bus */
    _Atomic uint32_t reserved;
    _Atomic uint64_t lost_count;  /* times it was lost: contexts from before a loss stay broken */
    struct sim_xid_record xid[SIM_XID_RING];
};

struct sim_gpu_live {
    _Atomic uint64_t used;        /* bytes held by all processes */
    _Atomic uint64_t busy_until;  /* CLOCK_MONOTONIC ns when queued work ends */
    _Atomic uint64_t busy_total;  /* device ns ever scheduled */
    _Atomic uint64_t ring_head;
    struct sim_exec_record ring[SIM_RING];
    struct sim_gpu_fault fault;
    _Atomic uint32_t compute_mode; /* nvmlComputeMode_t: 0 default, 3 exclusive process */
    uint32_t reserved;
};

enum sim_slot_state { SIM_SLOT_FREE = 0, SIM_SLOT_CLAIMING = 1, SIM_SLOT_LIVE = 2 };

struct sim_proc_slot {
    _Atomic uint32_t state;
    _Atomic int32_t pid;          /* as the owner sees itself: see sim_slot_pid */
    _Atomic uint64_t generation;  /* bumped on every claim */
    _Atomic uint64_t pidns;       /* inode of the owner's pid namespace, 0 if unknown */
    _Atomic uint64_t used[SIM_MAX_GPUS];
    _Atomic uint64_t busy_ns[SIM_MAX_GPUS];
    _Atomic uint32_t gpu_mask;    /* GPUs this process has a context on */
    char comm[16];
    /* MPS (mps_client.c, mps_server.c): a server holds the GPUs' one
     * context; a client runs beside the other clients of its server, on
     * its own lane per GPU, limited to mps_pct percent of the SMs. */
    _Atomic uint32_t mps_role;    /* enum sim_mps_role */
    _Atomic uint32_t mps_pct;     /* a client's active thread percentage, 1-100 */
    _Atomic int32_t mps_server;   /* a client's server: its slot ... */
    uint32_t reserved;
    _Atomic uint64_t mps_server_gen; /* ... and that slot's generation */
    _Atomic uint64_t mps_lane[SIM_MAX_GPUS];      /* ns when a client's queued work ends */
    _Atomic uint64_t mps_mem_limit[SIM_MAX_GPUS]; /* pinned device memory limit, bytes; 0: none */
};

enum sim_mps_role { SIM_MPS_NONE = 0, SIM_MPS_SERVER = 1, SIM_MPS_CLIENT = 2 };

struct sim_state {
    uint64_t magic;
    uint32_t version;
    uint32_t size;
    uint64_t config_hash;
    struct sim_config config;
    struct sim_gpu_live gpu[SIM_MAX_GPUS];
    struct sim_proc_slot proc[SIM_MAX_PROCS];
    /* Bumped on every fault change; a futex word that NVML event waits
     * sleep on (shared mapping, so not FUTEX_PRIVATE). */
    _Atomic uint32_t fault_epoch;
    _Atomic uint32_t mig_created; /* GPU instances ever created at run time: their UUIDs differ */
};

/* Byte offset of the lock that keeps process slot i alive. The lock bytes lie
 * past the mapped structure so that nobody ever reads or writes them. */
#define SIM_SLOT_LOCK_OFFSET(i) ((long)sizeof(struct sim_state) + (long)(i))
/* Byte offset of slot i's pid lock: a classic POSIX record lock its owner
 * holds, only so that F_GETLK tells others the owner's pid in *their* pid
 * namespace (the kernel translates l_pid, 0 when not visible there), as a
 * real driver reports pids to each caller. Liveness stays on the OFD lock. */
#define SIM_SLOT_PID_OFFSET(i) ((long)sizeof(struct sim_state) + SIM_MAX_PROCS + (long)(i))
/* The byte whose OFD lock a process holds while it changes the MIG layout
 * (simmig.c): the kernel drops it if that process dies. */
#define SIM_MIG_LOCK_OFFSET ((long)sizeof(struct sim_state) + 2L * SIM_MAX_PROCS)

/* The process's view of the simulation. */
struct sim_handle {
    struct sim_state *st;
    int fd;
    int slot;                     /* -1 until the process claims one */
    /* Slot locks belong to the one open file description, shared by all our
     * threads: two of them reaping at once would drop each other's locks. */
    pthread_mutex_t reap_lock;
};

void sim_config_defaults(struct sim_config *cfg);

/* Parse a configuration file (format in docs/simulated-gpu.md); NULL path
 * gives the default machine. Returns 0, or -1 with a message in err. */
int sim_config_load(const char *path, struct sim_config *cfg, char *err, size_t errlen);

/* Map (creating if absent) the state named by CGPU_SIM_STATE for the
 * configuration named by CGPU_SIM_CONFIG. Returns 0, or -1 with a message. */
int sim_attach(struct sim_handle *h, char *err, size_t errlen);
void sim_detach(struct sim_handle *h);

/* Claim a process slot for the calling process (idempotent). 0 or -1. */
int sim_claim_slot(struct sim_handle *h);

/* Return the memory and slots of processes that have died. Lock-free and safe
 * to run from several processes at once; returns slots reclaimed. */
int sim_reap_dead(struct sim_handle *h);

/* Charge or release device memory. sim_mem_charge fails (false) when the GPU
 * has less than `bytes` free after reaping dead processes. */
bool sim_mem_charge(struct sim_handle *h, int gpu, uint64_t bytes);
void sim_mem_release(struct sim_handle *h, int gpu, uint64_t bytes);

/* Reserve `dur_ns` of device time on `gpu` starting no earlier than
 * `not_before`; returns the end time. Blocks (sleeping) while the caller
 * already has more than queue_ns of work queued ahead of now. */
uint64_t sim_exec_reserve(struct sim_handle *h, int gpu, uint64_t not_before, uint64_t dur_ns);

/* Compute modes, numbered as nvmlComputeMode_t and CUcomputemode number
 * them. Set through nvmlDeviceSetComputeMode; a new state starts Default,
 * as a GPU does after a reboot. */
enum sim_compute_mode {
    SIM_COMPUTEMODE_DEFAULT = 0,
    SIM_COMPUTEMODE_EXCLUSIVE_THREAD = 1, /* gone from CUDA; treated as exclusive process */
    SIM_COMPUTEMODE_PROHIBITED = 2,
    SIM_COMPUTEMODE_EXCLUSIVE_PROCESS = 3,
};

/* Put the calling process on `gpu` (its first context there): charge the
 * driver's context memory (`ctx_bytes`) and mark the GPU in its mask,
 * unless the compute mode refuses it: PROHIBITED always, EXCLUSIVE_PROCESS
 * while another process holds the GPU (sim_excludes). 0 on the GPU (or
 * already), -1 out of memory, -2 unavailable. Serialise per process. */
int sim_use_gpu(struct sim_handle *h, int gpu, uint64_t ctx_bytes);

/* MPS. Whether slot i is a client of a live server (its server's slot still
 * holds the generation it connected to), and whether it is a holder of
 * `gpu` that excludes the caller (slot `self`) under EXCLUSIVE_PROCESS:
 * any other live process with a context there, except the caller's own
 * server and that server's live clients. */
bool sim_mps_client_live(const struct sim_state *st, int i);
bool sim_excludes(const struct sim_state *st, int self, int i, int gpu);
/* An MPS client's part of the SMs of `gpu` at `now`, in percent: its
 * active thread percentage, scaled down when its server's clients with work
 * queued past `now` together ask for more than the GPU has. */
uint32_t sim_mps_share(const struct sim_state *st, int slot, int gpu, uint64_t now);

/* The pid namespace of the calling process (inode), 0 if /proc cannot say. */
uint64_t sim_pidns_self(void);

/* The pid of slot i's owner in the caller's pid namespace (`self_ns` from
 * sim_pidns_self), as a real driver reports it: the recorded pid in the
 * owner's own namespace, else the kernel's translation of the slot's pid
 * lock, else (the owner closed a descriptor of the state file, which drops
 * POSIX locks) a /proc search by namespace and NSpid. 0 when the owner is
 * not visible from the caller's namespace. Check the slot's generation after
 * the call: a slot claimed again meanwhile gives the new owner's pid. */
int32_t sim_slot_pid(const struct sim_handle *h, int slot, uint64_t self_ns);

/* The time of one process (slot, generation) in a window; pid and pidns are
 * those recorded with it (the owner's own namespace). */
struct sim_pid_busy {
    int32_t pid;
    uint32_t slot;
    uint64_t generation;
    uint64_t pidns;
    uint64_t ns;
};

/* Device busy time of `gpu` in [from, to) from the execution records (an
 * MPS client's stretch counts its percent of the SMs: the GPU's work): the
 * total, and per process (slot, generation) for up to `cap` processes.
 * Returns false if the records no longer reach back to `from`. Lock-free;
 * safe while others write. */
bool sim_busy_between(const struct sim_state *st, int gpu, uint64_t from, uint64_t to, uint64_t *total,
                      struct sim_pid_busy *per_pid, int cap, int *n_pids);

/* Faults. sim_fault_xid reports an XID on `gpu`; sim_fault_set_lost takes
 * the GPU off the bus (reporting XID 79) or brings it back (a reset). Both
 * wake every NVML event wait. Lock-free. */
void sim_fault_xid(struct sim_state *st, int gpu, uint64_t xid);
void sim_fault_set_lost(struct sim_state *st, int gpu, bool lost);
bool sim_gpu_lost(const struct sim_state *st, int gpu);
uint64_t sim_gpu_lost_count(const struct sim_state *st, int gpu);

/* XID number `seq` (0-based, below xid_head) of `gpu`: 1 and *xid when
 * published, 0 while its writer is still writing, -1 when the ring has
 * reused its slot (the reader fell more than SIM_XID_RING behind). */
int sim_xid_read(const struct sim_state *st, int gpu, uint64_t seq, uint64_t *xid);

/* Sleep until fault_epoch differs from `seen`, at most timeout_ns. 0 when
 * woken or timed out, -1 if a signal interrupted the sleep. */
int sim_fault_wait(struct sim_state *st, uint32_t seen, uint64_t timeout_ns);

uint64_t sim_now_ns(void);
/* Sleep until sim_now_ns() reaches t_ns; at once if it has. */
void sim_sleep_until(uint64_t t_ns);

#endif
