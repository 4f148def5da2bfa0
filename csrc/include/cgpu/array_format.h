/* Bytes of one channel of a CUDA array element, by format: what libcgpu.so
 * charges for an array and what the simulated driver holds for it.
 * Header only; no state. */
#ifndef CGPU_ARRAY_FORMAT_H
#define CGPU_ARRAY_FORMAT_H

#include <stdint.h>

#include "cgpu/cuda_abi.h"

/* 0 for a format not listed here (the wider and packed ones). */
static inline uint64_t cgpu_array_format_bytes(CUarray_format f)
{
    switch (f) {
    case CU_AD_FORMAT_UNSIGNED_INT8:
    case CU_AD_FORMAT_SIGNED_INT8: return 1;
    case CU_AD_FORMAT_UNSIGNED_INT16:
    case CU_AD_FORMAT_SIGNED_INT16:
    case CU_AD_FORMAT_HALF: return 2;
    case CU_AD_FORMAT_UNSIGNED_INT32:
    case CU_AD_FORMAT_SIGNED_INT32:
    case CU_AD_FORMAT_FLOAT: return 4;
    default: return 0;
    }
}

#endif /* CGPU_ARRAY_FORMAT_H */
