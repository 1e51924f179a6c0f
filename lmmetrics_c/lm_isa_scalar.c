/* The portable kernels (any compiler, any CPU), and the only float64 one:
 * float64 input runs in double lanes with libm's exp. */
#include "lm_internal.h"

#define LMV_LANE float
#include "lm_simd_scalar.h"
#include "lm_instantiate.h"
#undef LMV_LANE

#define LMV_LANE double
#define LM_LIBM_EXP
#include "lm_simd_scalar.h"
#define LM_ELEM double
#define LM_ELEM_NEGINF (-INFINITY)
#define LM_LOAD2 LM_LOAD2_F64
#define LM_LANE_ELEM LM_LANE_F64
#define LM_FN(name) LM_NAME3(name, LM_ISA_TAG, f64)
#include "lm_body.h"

const lm_unit lm_unit_scalar = {
    {[LM_F32] = segment_scalar_f32, [LM_F64] = segment_scalar_f64,
     [LM_F16] = segment_scalar_f16, [LM_BF16] = segment_scalar_bf16},
    read_scalar_f32};
