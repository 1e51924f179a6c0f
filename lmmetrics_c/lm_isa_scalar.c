/* The portable kernels (any compiler, any CPU): float lanes for the 16- and
 * 32-bit dtypes, and float64 in a double lane with libm's exp. */
#include "lm_internal.h"

#define LMV_LANE float
#include "lm_simd_scalar.h"
#define LM_SIMD_F64 "lm_simd_scalar_f64.h"
#include "lm_instantiate.h"

const lm_unit lm_unit_scalar = {
    {[LM_F32] = segment_scalar_f32, [LM_F64] = segment_scalar_f64,
     [LM_F16] = segment_scalar_f16, [LM_BF16] = segment_scalar_bf16},
    {[LM_F32] = value_scalar_f32, [LM_F64] = value_scalar_f64, [LM_F16] = value_scalar_f16,
     [LM_BF16] = value_scalar_bf16},
    read_scalar_f32};
