/* Parsing the MPS environment variables the way the simulated driver, the
 * control daemon and the server all read them (mps_wire.h). */
#define _GNU_SOURCE
#include "mps_wire.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

bool mps_parse_mem_limits(const char *spec, uint64_t limits[MPS_MAX_DEVICES])
{
    uint64_t got[MPS_MAX_DEVICES] = {0};
    char buf[MPS_LINE_MAX];
    if (snprintf(buf, sizeof(buf), "%s", spec) >= (int)sizeof(buf))
        return false;
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        while (*tok == ' ')
            tok++;
        char *eq = strchr(tok, '=');
        if (!eq)
            return false;
        *eq = '\0';
        char *end;
        long ord = strtol(tok, &end, 10);
        if (end == tok || *end != '\0' || ord < 0 || ord >= MPS_MAX_DEVICES)
            return false;
        if (mps_parse_size(eq + 1, &got[ord]) != 0)
            return false;
    }
    memcpy(limits, got, sizeof(got));
    return true;
}

uint32_t mps_parse_percent(const char *s)
{
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end != '\0' || !(v > 0.0) || v > 100.0)
        return 0;
    uint32_t p = (uint32_t)v;
    return p ? p : 1;
}
