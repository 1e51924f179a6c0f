/* The AVX-512 kernels (F and BW); built with setup.py's avx512 flags only. */
#include "lm_internal.h"
#include "lm_simd_avx512.h"
#define LM_SIMD_F64 "lm_simd_avx512_f64.h"
#include "lm_instantiate.h"

const lm_unit lm_unit_avx512 = {
    {[LM_F32] = segment_avx512_f32, [LM_F64] = segment_avx512_f64, [LM_F16] = segment_avx512_f16,
     [LM_BF16] = segment_avx512_bf16},
    {[LM_F32] = value_avx512_f32, [LM_F64] = value_avx512_f64, [LM_F16] = value_avx512_f16,
     [LM_BF16] = value_avx512_bf16},
    read_avx512_f32};
