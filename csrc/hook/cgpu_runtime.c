/* cgpu-runtime: the OCI runtime shim containerd and docker call instead of
 * runc. For now it only relays: every command goes to the real runtime
 * unchanged. The create path that asks cgpud to prepare a GPU bundle comes
 * with the container issue; this binary exists so packaging, runtime
 * configuration and tests have their real file from day one. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define CGPU_VERSION "0.1.0"
#define REAL_RUNTIME "runc"

int main(int argc, char **argv)
{
    (void)argc;
    if (argv[1] && strcmp(argv[1], "--version") == 0) {
        printf("cgpu-runtime %s (relays to %s)\n", CGPU_VERSION, REAL_RUNTIME);
        fflush(stdout);
    }
    argv[0] = (char *)REAL_RUNTIME;
    execvp(REAL_RUNTIME, argv);
    /* Fails closed: a GPU container must not start without its limits. */
    fprintf(stderr, "cgpu-runtime: cannot run %s: %s (install runc or put it on PATH)\n", REAL_RUNTIME,
            strerror(errno));
    return 127;
}
