/* AArch64 NEON primitives for lm_body.h in 2 double lanes: the float64
 * kernels (LM_EXP64: the body's double exp). lm_isa_neon.c includes it
 * after lm_simd_neon.h, whose float primitives it replaces. */
#ifndef LM_INTERNAL_H
#error "lm_simd_neon_f64.h is not a standalone header: lm_isa_neon.c includes it"
#endif
#include "lm_simd_undef.h"
#undef LMV_LANE

#define LM_EXP64 1
#define lmv_t float64x2_t
#define LMV_LANE double
#define LMV_W 2
#define lmv_set1(x) vdupq_n_f64((double)(x))
#define lmv_loadu(p) vld1q_f64((const double *)(p)) /* LMV_W lanes, unaligned */
#define lmv_add vaddq_f64
#define lmv_sub vsubq_f64
#define lmv_mul vmulq_f64
#define lmv_div vdivq_f64
#define lmv_fma(a, b, c) vfmaq_f64(c, a, b) /* a * b + c, one rounding */
/* a > b ? a : b: a NaN in b survives, a NaN in a is dropped (as x86's
 * max; NEON's own vmaxq_f64 would return a NaN from either side) */
#define lmv_max(a, b) vbslq_f64(vcgtq_f64(a, b), a, b)
#define lmv_min(a, b) vbslq_f64(vcltq_f64(a, b), a, b)
#define lmv_store vst1q_f64
#define lmv_abs vabsq_f64
/* 2^(n + j/8) for t holding 8n + j in its low bits (see
 * LM_POW2Q64_TABLE8): each lane's entry loaded from the 8-entry table by
 * its index (two lanes: two scalar indices, one load and one lane load),
 * and n added into the exponent field. A 64-byte byte-table lookup
 * (vqtbl4q_u8, its byte indices 8j + 0..7 made by a transpose, an and and
 * a multiply-add) took more instructions in the loop: 75 against 72 a
 * step (GCC 12, which also moved the four table registers through the
 * stack every step), 85 against 83 (clang). */
#define LM_QBITS 3
static const uint64_t lm_neon_pow2q64_tab[8] = {LM_POW2Q64_TABLE8(LM_Q8D_BITS)};
static inline float64x2_t lm_neon_pow2q_f64(float64x2_t t) {
    const uint64x2_t tu = vreinterpretq_u64_f64(t);
    const uint64x2_t e = vld1q_lane_u64(&lm_neon_pow2q64_tab[vgetq_lane_u64(tu, 1) & 7u],
        vcombine_u64(vld1_u64(&lm_neon_pow2q64_tab[vgetq_lane_u64(tu, 0) & 7u]), vdup_n_u64(0u)), 1);
    return vreinterpretq_f64_s64(vaddq_s64(vreinterpretq_s64_u64(e),
                                           vshlq_n_s64(vreinterpretq_s64_f64(t), 52 - LM_QBITS)));
}
#define lmv_pow2q lm_neon_pow2q_f64
/* the lane sums are double already: flushed into a second set of lanes */
#define lmv_wide_t float64x2_t
#define lmv_wide_zero() vdupq_n_f64(0.0)
#define lmv_wide_add vaddq_f64
#define lmv_wide_sum vaddvq_f64
/* nonzero when some lane of a equals the same lane of b */
#define lmv_any_eq(a, b) vmaxvq_u32(vreinterpretq_u32_u64(vceqq_f64(a, b)))
/* x where y >= lo, else 0 (NaN in y: 0) */
#define lmv_zero_below(x, y, lo)                                                 \
    vreinterpretq_f64_u64(vandq_u64(vreinterpretq_u64_f64(x), vcgeq_f64(y, lo)))
/* the rank's count: lanes where x > t (ordered), added to int lanes */
#define lmv_cnt_t uint64x2_t
#define lmv_cnt_zero() vdupq_n_u64(0u)
#define lmv_cnt_gt(c, x, t) vsubq_u64(c, vcgtq_f64(x, t))
#define lmv_cnt_sum(c) ((int64_t)vaddvq_u64(c))

#define LM_LOAD2_F64(p, a, b)                                                  \
    do { a = vld1q_f64(p); b = vld1q_f64((p) + 2); } while (0)
#define LM_LANE_F64(k) (k)
