/* The AVX2 + FMA + F16C kernels; built with -mavx2 -mfma -mf16c only. */
#include "lm_internal.h"
#include "lm_simd_avx2.h"
#define LM_SIMD_F64 "lm_simd_avx2_f64.h"
#include "lm_instantiate.h"

const lm_unit lm_unit_avx2 = {
    {[LM_F32] = segment_avx2_f32, [LM_F64] = segment_avx2_f64, [LM_F16] = segment_avx2_f16,
     [LM_BF16] = segment_avx2_bf16},
    {[LM_F32] = value_avx2_f32, [LM_F64] = value_avx2_f64, [LM_F16] = value_avx2_f16,
     [LM_BF16] = value_avx2_bf16},
    read_avx2_f32};
