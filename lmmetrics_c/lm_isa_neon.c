/* The AArch64 NEON kernels (baseline on aarch64: no flags). */
#include "lm_internal.h"
#include "lm_simd_neon.h"
#define LM_SIMD_F64 "lm_simd_neon_f64.h"
#include "lm_instantiate.h"

const lm_unit lm_unit_neon = {
    {[LM_F32] = segment_neon_f32, [LM_F64] = segment_neon_f64, [LM_F16] = segment_neon_f16,
     [LM_BF16] = segment_neon_bf16},
    {[LM_F32] = value_neon_f32, [LM_F64] = value_neon_f64, [LM_F16] = value_neon_f16,
     [LM_BF16] = value_neon_bf16},
    read_neon_f32};
