/* cgpu-hook: the OCI hook relay. The runtime runs it with the container
 * state JSON on stdin. For now it checks that a state arrived and exits 0;
 * forwarding the state to cgpud over its unix socket comes with the
 * container issue. */
#include <stdio.h>
#include <string.h>

#define MAX_STATE (1 << 20)

int main(int argc, char **argv)
{
    static char state[MAX_STATE];
    if (argc > 1 && strcmp(argv[1], "--version") == 0) {
        puts("cgpu-hook 0.1.0");
        return 0;
    }
    size_t n = fread(state, 1, sizeof(state) - 1, stdin);
    size_t lead = strspn(state, " \t\r\n");
    if (n == 0 || lead >= n || state[lead] != '{') {
        fprintf(stderr, "cgpu-hook: expected the OCI container state (a JSON object) on stdin\n");
        return 1;
    }
    if (n == sizeof(state) - 1) {
        fprintf(stderr, "cgpu-hook: container state larger than %d bytes\n", MAX_STATE - 1);
        return 1;
    }
    return 0;
}
