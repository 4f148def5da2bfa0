/* Prototypes of every entry point in cuda_functions.def, under its exported
 * name. Included by cuda_abi.h when NVIDIA's cuda.h is not used. */
#ifndef CGPU_CUDA_FUNCTIONS_H
#define CGPU_CUDA_FUNCTIONS_H

#define CU_FN(symbol, base, since, kind, params) CUresult CUDAAPI symbol params;
#include "cuda_functions.def"
#undef CU_FN

#endif
