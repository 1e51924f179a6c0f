/* Instantiates lm_body.h for the 16- and 32-bit dtypes with the primitives
 * of the lm_simd_*.h included before. The functions made, for <isa> =
 * LM_ISA_TAG (scalar, avx2, avx512, neon), are
 *   segment_<isa>_f32, segment_<isa>_f16, segment_<isa>_bf16  (lm_segment_fn)
 *   read_<isa>_f32                                            (lm_read_fn)
 * (each with its static inline helpers, e.g. block__<isa>_f32), and, where
 * the unit names its double-lane primitives in LM_SIMD_F64 (a header
 * included last, replacing the float ones),
 *   segment_<isa>_f64
 * They are exported through each unit's lm_unit (lm_unit_<isa>). */
#define LM_NAME3_(a, b, c) a##_##b##_##c
#define LM_NAME3(a, b, c) LM_NAME3_(a, b, c)

#define LM_ELEM float
#define LM_ELEM_NEGINF (-INFINITY)
#define LM_RAW16 0
#define LM_LOAD2 LM_LOAD2_F32
#define LM_LANE_ELEM LM_LANE_F32
#define LM_FN(name) LM_NAME3(name, LM_ISA_TAG, f32)
#include "lm_body.h"
/* The read pass (lm_bench.h): the max of n floats (n a multiple of
 * 8 LMV_W) by eight independent max chains, with or without a prefetch of
 * each line LM_PREFETCH_BYTES ahead. */
LM_INLINE float LM_FN(read_)(const float *p, int64_t n, const int prefetch) {
    lmv_t m[8];
    for (int k = 0; k < 8; k++) m[k] = lmv_set1(-INFINITY);
    for (int64_t i = 0; i < n; i += 8 * LMV_W) {
        if (prefetch)
            for (int q = 0; q < 8 * LMV_W * 4; q += LM_LINE)
                LM_PREFETCH((uintptr_t)(p + i) + (uintptr_t)(LM_PREFETCH_BYTES + q)); /* may pass the end */
        for (int k = 0; k < 8; k++) m[k] = lmv_max(lmv_loadu(p + i + k * LMV_W), m[k]);
    }
    for (int k = 1; k < 8; k++) m[0] = lmv_max(m[k], m[0]);
    return LM_FN(hmax_)(m[0]);
}
static float LM_NAME3(read, LM_ISA_TAG, f32)(const float *p, int64_t n, int prefetch) {
    return prefetch ? LM_FN(read_)(p, n, 1) : LM_FN(read_)(p, n, 0);
}

#undef LM_ELEM
#undef LM_ELEM_NEGINF
#undef LM_LOAD2
#undef LM_LANE_ELEM
#undef LM_FN

#define LM_ELEM uint16_t
#define LM_ELEM_NEGINF ((uint16_t)0xfc00u)
#undef LM_RAW16
#define LM_RAW16 1 /* 16-bit sign-magnitude: LM_ELEM_POSINF, LM_ELEM_TO_FLOAT */
#define LM_ELEM_POSINF 0x7c00
#define LM_ELEM_TO_FLOAT lm_f16_to_float
#define LM_LOAD2 LM_LOAD2_F16
#define LM_LANE_ELEM LM_LANE_F16
#define LM_FN(name) LM_NAME3(name, LM_ISA_TAG, f16)
#include "lm_body.h"
#undef LM_ELEM_NEGINF
#undef LM_LOAD2
#undef LM_LANE_ELEM
#undef LM_FN

#undef LM_ELEM_POSINF
#undef LM_ELEM_TO_FLOAT
#define LM_ELEM_NEGINF ((uint16_t)0xff80u)
#define LM_ELEM_POSINF 0x7f80
#define LM_ELEM_TO_FLOAT lm_bf16_to_float
#define LM_LOAD2 LM_LOAD2_BF16
#define LM_LANE_ELEM LM_LANE_BF16
#define LM_FN(name) LM_NAME3(name, LM_ISA_TAG, bf16)
#include "lm_body.h"
#undef LM_ELEM
#undef LM_ELEM_NEGINF
#undef LM_LOAD2
#undef LM_LANE_ELEM
#undef LM_FN
#undef LM_RAW16
#undef LM_ELEM_POSINF
#undef LM_ELEM_TO_FLOAT

#ifdef LM_SIMD_F64 /* float64 in double lanes */
#include LM_SIMD_F64
#define LM_ELEM double
#define LM_ELEM_NEGINF (-INFINITY)
#define LM_RAW16 0
#define LM_LOAD2 LM_LOAD2_F64
#define LM_LANE_ELEM LM_LANE_F64
#define LM_FN(name) LM_NAME3(name, LM_ISA_TAG, f64)
#include "lm_body.h"
#undef LM_ELEM
#undef LM_ELEM_NEGINF
#undef LM_RAW16
#undef LM_LOAD2
#undef LM_LANE_ELEM
#undef LM_FN
#endif
