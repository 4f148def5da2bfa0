/* The relay protocol between the container start path (cgpu-runtime,
 * cgpu-hook) and cgpud: its one description. cgpud reads these constants
 * through cffi (cgpud._region, build_region.py), so this header holds only
 * plain integer and string #defines.
 *
 * One request per connection. The client writes its request and shuts down
 * its writing side; cgpud answers one line and closes.
 *   request: "<verb> <arg> [<arg>]\n", then a body up to EOF;
 *            at most CGPU_RELAY_MAX_REQUEST bytes in all
 *     prepare <container-id>[ shim-binds[ spec-fd]]\n<absolute bundle path>
 *       shim-binds: the shim binds after `create` and releases after
 *       `delete` itself (bind/release below), so no hook entry is written
 *       spec-fd: the bundle's config.json comes open, as the request's one
 *       descriptor (SCM_RIGHTS): its path holds the shim's FIFO by then.
 *       The edit is renamed over the path as always. Any other request
 *       with a descriptor is refused
 *     hook <stage> <instance-id>\n<OCI state JSON>
 *     bind <instance-id>\n<OCI state JSON with the init pid>
 *     release <instance-id>\n<OCI state JSON>
 *       the createRuntime and poststop hooks' work, asked by the shim
 *   answer:  "ok[ <text>]\n" or "error <one-line message>\n";
 *            at most CGPU_RELAY_MSG_MAX bytes, the "\n" included
 * A line protocol rather than cgpud's gRPC API: a C relay then needs no
 * HTTP/2 stack and costs about a millisecond per container, not tens. */
#ifndef CGPU_RELAY_WIRE_H
#define CGPU_RELAY_WIRE_H

#define CGPU_RELAY_DEFAULT_SOCKET "/run/cgpud/relay.sock"
#define CGPU_RELAY_MAX_REQUEST 1048576
#define CGPU_RELAY_MSG_MAX 4096
/* prepare's flags (above): the shim sends none, the first, or both. */
#define CGPU_RELAY_SHIM_BINDS "shim-binds"
#define CGPU_RELAY_SPEC_FD "spec-fd"
/* How long a relay waits for cgpud at each step. */
#define CGPU_RELAY_TIMEOUT_S 30
/* How long a relay keeps retrying while cgpud is down (its socket missing
 * or refusing, or cgpud gone before answering): a restart takes 1-3 s.
 * Well below what containerd and runc give a runtime call, and below the
 * timeout cgpud writes into its hook entries (HOOK_TIMEOUT, edits.py). */
#define CGPU_RELAY_WAIT_S 10

/* cgpu-runtime (every runtime command) hands a GPU start to this program,
 * found in the directory of its own real file. */
#define CGPU_RUNTIME_GPU_PROGRAM "cgpu-runtime-gpu"

/* runc's limit on a container id. An instance id is at most
 * CGPU_INSTANCE_ID_LEN - 1 bytes (cgpu/region.h): the region holds it. */
#define CGPU_CONTAINER_ID_MAX 1024

/* Every env variable a container spec asks for a GPU share with starts so
 * (ALIYUN_COM_GPU_MEM_CONTAINER, ...): the runtime shim scans for it. */
#define CGPU_ENV_PREFIX "ALIYUN_COM_GPU"

/* What the NVIDIA container toolkit gives GPUs by: a container that names
 * it goes to cgpud too, which sets it to "void" where the container has no
 * instance on an isolating node (request.py TOOLKIT_ENV). */
#define CGPU_TOOLKIT_ENV "NVIDIA_VISIBLE_DEVICES"

#endif
