/* The AVX2 + FMA + F16C kernels; built with -mavx2 -mfma -mf16c only. */
#include "lm_internal.h"
#include "lm_simd_avx2.h"
#include "lm_instantiate.h"

const lm_segment_fn lm_kernels_avx2[LM_NDTYPES] = {
    [LM_F32] = segment_avx2_f32, [LM_F16] = segment_avx2_f16, [LM_BF16] = segment_avx2_bf16};
const lm_read_fn lm_read_avx2 = read_avx2_f32;
