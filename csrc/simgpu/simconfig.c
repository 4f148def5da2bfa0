/* Configuration of the simulated machine: a small line-based file so that
 * both C and a shell script can write it. Format in docs/simulated-gpu.md. */
#define _GNU_SOURCE
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "simmig.h"
#include "simstate.h"

static void default_gpu(struct sim_gpu_config *g, unsigned idx)
{
    memset(g, 0, sizeof(*g));
    snprintf(g->name, sizeof(g->name), "NVIDIA H100 80GB HBM3");
    g->total_mem = 80ULL << 30;
    g->sm_count = 132;
    g->cc_major = 9;
    g->cc_minor = 0;
    g->pci_bus = 0x18 + idx * 0x10;
    g->pci_device_id = 0x233010de;
    g->minor_number = idx;
}

/* Fields derived from others unless the file set them explicitly. */
static void finish_gpu(struct sim_gpu_config *g, unsigned idx)
{
    if (g->uuid[0] == '\0')
        snprintf(g->uuid, sizeof(g->uuid), "GPU-5c1a0000-0000-4000-8000-%012x", 0xc90000u + idx);
    if (g->pci_bus_id[0] == '\0')
        snprintf(g->pci_bus_id, sizeof(g->pci_bus_id), "%08X:%02X:%02X.0", g->pci_domain, g->pci_bus,
                 g->pci_device);
}

void sim_config_defaults(struct sim_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->gpu_count = 2;
    cfg->driver_version = 13000;
    snprintf(cfg->driver_version_str, sizeof(cfg->driver_version_str), "580.65.06");
    cfg->queue_ns = 2000000;
    cfg->default_kernel_ns = 10000;
    for (unsigned i = 0; i < SIM_MAX_GPUS; i++)
        default_gpu(&cfg->gpu[i], i);
}

static int parse_size(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0)
        return -1;
    uint64_t mult = 1;
    if (!strcasecmp(end, "") || !strcasecmp(end, "B"))
        mult = 1;
    else if (!strcasecmp(end, "KiB"))
        mult = 1ULL << 10;
    else if (!strcasecmp(end, "MiB"))
        mult = 1ULL << 20;
    else if (!strcasecmp(end, "GiB") || !strcasecmp(end, "G"))
        mult = 1ULL << 30;
    else
        return -1;
    if (v * (double)mult > 1.8e19)
        return -1;
    *out = (uint64_t)(v * (double)mult);
    return 0;
}

static int parse_uint(const char *s, uint32_t *out, int base)
{
    char *end;
    errno = 0;
    unsigned long v = strtoul(s, &end, base);
    if (errno || end == s || *end != '\0' || v > UINT32_MAX)
        return -1;
    *out = (uint32_t)v;
    return 0;
}

/* Splits `key=value` or `key="quoted value"` tokens off *p. */
static int next_token(char **p, char **key, char **val)
{
    char *s = *p;
    while (isspace((unsigned char)*s))
        s++;
    if (*s == '\0')
        return 0;
    *key = s;
    while (*s && *s != '=' && !isspace((unsigned char)*s))
        s++;
    if (*s != '=')
        return -1;
    *s++ = '\0';
    if (*s == '"') {
        *val = ++s;
        while (*s && *s != '"')
            s++;
        if (*s != '"')
            return -1;
        *s++ = '\0';
    } else {
        *val = s;
        while (*s && !isspace((unsigned char)*s))
            s++;
        if (*s)
            *s++ = '\0';
    }
    *p = s;
    return 1;
}

static int set_gpu_field(struct sim_gpu_config *g, const char *key, const char *val)
{
    if (!strcmp(key, "name"))
        return snprintf(g->name, sizeof(g->name), "%s", val) >= (int)sizeof(g->name) ? -1 : 0;
    if (!strcmp(key, "uuid"))
        return snprintf(g->uuid, sizeof(g->uuid), "%s", val) >= (int)sizeof(g->uuid) ? -1 : 0;
    if (!strcmp(key, "mem"))
        return parse_size(val, &g->total_mem) || g->total_mem == 0 ? -1 : 0;
    if (!strcmp(key, "sms"))
        return parse_uint(val, &g->sm_count, 10) || g->sm_count == 0 ? -1 : 0;
    if (!strcmp(key, "cc"))
        return sscanf(val, "%u.%u", &g->cc_major, &g->cc_minor) == 2 ? 0 : -1;
    if (!strcmp(key, "pci")) {
        if (sscanf(val, "%x:%x:%x.0", &g->pci_domain, &g->pci_bus, &g->pci_device) != 3)
            return -1;
        g->pci_bus_id[0] = '\0';
        return 0;
    }
    if (!strcmp(key, "nvlink")) { /* peers, each "i" (one link) or "i*n" (n links) */
        g->nvlink_peers = 0;
        memset(g->nvlink_links, 0, sizeof(g->nvlink_links));
        char buf[128];
        if (snprintf(buf, sizeof(buf), "%s", val) >= (int)sizeof(buf))
            return -1;
        for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            uint32_t peer, links = 1;
            char *star = strchr(t, '*');
            if (star) {
                *star = '\0';
                if (parse_uint(star + 1, &links, 10) || links == 0 || links > 18)
                    return -1;
            }
            if (parse_uint(t, &peer, 10) || peer >= SIM_MAX_GPUS)
                return -1;
            g->nvlink_peers |= 1u << peer;
            g->nvlink_links[peer] = (uint8_t)links;
        }
        return 0;
    }
    if (!strcmp(key, "nvswitch"))
        return parse_uint(val, &g->nvswitch_links, 10) || g->nvswitch_links > 18 ? -1 : 0;
    uint32_t *place = !strcmp(key, "switch")   ? &g->pcie_switch
                      : !strcmp(key, "bridge") ? &g->host_bridge
                      : !strcmp(key, "socket") ? &g->cpu_socket
                                               : NULL;
    if (place) {
        uint32_t id;
        if (parse_uint(val, &id, 10) || id >= 1024)
            return -1;
        *place = id + 1;
        return 0;
    }
    return -1;
}

static int set_global_field(struct sim_config *cfg, const char *key, const char *val)
{
    uint32_t v;
    if (!strcmp(key, "driver_version"))
        return parse_uint(val, &cfg->driver_version, 10);
    if (!strcmp(key, "driver_version_string"))
        return snprintf(cfg->driver_version_str, sizeof(cfg->driver_version_str), "%s", val) >=
                       (int)sizeof(cfg->driver_version_str)
                   ? -1
                   : 0;
    if (!strcmp(key, "queue_us")) {
        if (parse_uint(val, &v, 10) || v == 0)
            return -1;
        cfg->queue_ns = (uint64_t)v * 1000;
        return 0;
    }
    if (!strcmp(key, "context_mib")) {
        if (parse_uint(val, &v, 10) || v > (1u << 20))
            return -1;
        cfg->context_bytes = (uint64_t)v << 20;
        return 0;
    }
    if (!strcmp(key, "default_kernel_us")) {
        if (parse_uint(val, &v, 10))
            return -1;
        cfg->default_kernel_ns = (uint64_t)v * 1000;
        return 0;
    }
    return -1;
}

int sim_config_load(const char *path, struct sim_config *cfg, char *err, size_t errlen)
{
    sim_config_defaults(cfg);
    if (path == NULL || path[0] == '\0') {
        for (unsigned i = 0; i < cfg->gpu_count; i++)
            finish_gpu(&cfg->gpu[i], i);
        for (unsigned i = cfg->gpu_count; i < SIM_MAX_GPUS; i++)
            memset(&cfg->gpu[i], 0, sizeof(cfg->gpu[i]));
        return 0;
    }
    FILE *f = fopen(path, "re");
    if (!f) {
        snprintf(err, errlen, "cannot open simulated GPU config %s: %s", path, strerror(errno));
        return -1;
    }
    char line[1024];
    char mig[SIM_MAX_GPUS][256]; /* each GPU's mig= setting, laid out once every GPU is known */
    memset(mig, 0, sizeof(mig));
    unsigned lineno = 0, gpus = 0;
    int rc = 0;
    while (rc == 0 && fgets(line, sizeof(line), f)) {
        lineno++;
        char *p = line, *key, *val;
        line[strcspn(line, "#\n")] = '\0';
        while (isspace((unsigned char)*p))
            p++;
        if (*p == '\0')
            continue;
        bool is_gpu = !strncmp(p, "gpu", 3) && (p[3] == '\0' || isspace((unsigned char)p[3]));
        if (is_gpu) {
            if (gpus >= SIM_MAX_GPUS) {
                snprintf(err, errlen, "%s:%u: more than %d GPUs", path, lineno, SIM_MAX_GPUS);
                rc = -1;
                break;
            }
            default_gpu(&cfg->gpu[gpus], gpus);
            p += 3;
        }
        int t;
        while ((t = next_token(&p, &key, &val)) == 1) {
            int bad;
            if (is_gpu && !strcmp(key, "mig"))
                bad = val[0] == '\0' || snprintf(mig[gpus], sizeof(mig[gpus]), "%s", val) >= (int)sizeof(mig[gpus]);
            else
                bad = is_gpu ? set_gpu_field(&cfg->gpu[gpus], key, val) : set_global_field(cfg, key, val);
            if (bad) {
                snprintf(err, errlen, "%s:%u: bad setting %s=%s", path, lineno, key, val);
                rc = -1;
                break;
            }
        }
        if (rc == 0 && t < 0) {
            snprintf(err, errlen, "%s:%u: expected key=value", path, lineno);
            rc = -1;
        }
        if (is_gpu)
            gpus++;
    }
    fclose(f);
    if (rc)
        return rc;
    if (gpus == 0) {
        snprintf(err, errlen, "%s: no 'gpu' line: describe at least one GPU", path);
        return -1;
    }
    cfg->gpu_count = gpus;
    for (unsigned i = 0; i < gpus; i++)
        finish_gpu(&cfg->gpu[i], i);
    for (unsigned i = gpus; i < SIM_MAX_GPUS; i++)
        memset(&cfg->gpu[i], 0, sizeof(cfg->gpu[i]));
    for (unsigned i = 0; i < gpus; i++) {
        char why[200];
        if (mig[i][0] && sim_mig_layout(cfg, i, mig[i], why, sizeof(why)) != 0) {
            snprintf(err, errlen, "%s: mig=%s: %s", path, mig[i], why);
            return -1;
        }
    }
    return 0;
}
