/* The portable primitives in one double lane with libm's exp
 * (LM_LIBM_EXP): the scalar unit's float64 kernels, the slow, obvious twin
 * of the vector paths' double exp. */
#undef LMV_LANE
#define LMV_LANE double
#define LM_LIBM_EXP
#include "lm_simd_scalar.h"
