/* Simulated libcuda.so.1: the entry points that only call another function
 * (driver_forwards.def), defined from one list so that a new variant is a
 * line, not a function. */
#include "driver.h"

#define CU_FWD(symbol, params, call) \
    SIM_EXPORT CUresult symbol params { return call; }
#include "driver_forwards.def"
#undef CU_FWD
