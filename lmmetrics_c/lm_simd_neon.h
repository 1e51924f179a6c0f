/* AArch64 NEON primitives for lm_body.h (4 float lanes); NEON (Advanced
 * SIMD, with fused multiply-add, vector divide and across-lane max) is
 * baseline on aarch64: no flags. Like lm_simd_avx2.h, with a 4-entry
 * table for the sums' exp (a quartic) and the same lane orders. */
#ifndef LM_INTERNAL_H
#error "lm_simd_neon.h is not a standalone header: lm_isa_neon.c includes it after lm_internal.h"
#endif
#include <arm_neon.h>

#define LM_ISA_TAG neon
#define lmv_t float32x4_t /* macros, not typedefs: lm_simd_neon_f64.h replaces them */
#define LMV_LANE float
#define LMV_W 4
#define lmv_set1(x) vdupq_n_f32((float)(x))
#define lmv_loadu(p) vld1q_f32((const float *)(p)) /* LMV_W lanes, unaligned */
#define lmv_add vaddq_f32
#define lmv_sub vsubq_f32
#define lmv_mul vmulq_f32
#define lmv_div vdivq_f32
#define lmv_fma(a, b, c) vfmaq_f32(c, a, b) /* a * b + c, one rounding */
/* a > b ? a : b: a NaN in b survives, a NaN in a is dropped (as x86's
 * max; NEON's own vmaxq_f32 would return a NaN from either side) */
#define lmv_max(a, b) vbslq_f32(vcgtq_f32(a, b), a, b)
/* a < b ? a : b: a NaN in b survives */
#define lmv_min(a, b) vbslq_f32(vcltq_f32(a, b), a, b)
#define lmv_store vst1q_f32
#define lmv_abs vabsq_f32
#define lmv_copysign(mag, s) vbslq_f32(vdupq_n_u32(0x80000000u), s, mag)
#define LM_NEON_I(x) vreinterpretq_s32_f32(x)
#define LM_NEON_F(x) vreinterpretq_f32_s32(x)
/* p * 2^n, n in [-125, 0] held in the low mantissa bits of t: add n to
 * p's exponent field */
#define lmv_scale(p, t) LM_NEON_F(vaddq_s32(LM_NEON_I(p), vshlq_n_s32(LM_NEON_I(t), 23)))
/* 2^(n + j/4) for t holding 4n + j in its low bits (see LM_POW2Q_TABLE4):
 * one byte table lookup, lane k taking bytes 4j .. 4j + 3 */
#define LM_QBITS 2
static const int32_t lm_neon_pow2q_tab[4] = {LM_POW2Q_TABLE4};
#define LM_NEON_TAB4(t)                                                        \
    vreinterpretq_s32_u8(vqtbl1q_u8(vreinterpretq_u8_s32(vld1q_s32(lm_neon_pow2q_tab)), \
        vreinterpretq_u8_u32(vmlaq_n_u32(vdupq_n_u32(0x03020100u),             \
            vandq_u32(vreinterpretq_u32_f32(t), vdupq_n_u32(3u)), 0x04040404u))))
#define lmv_pow2q(t)                                                             \
    LM_NEON_F(vaddq_s32(LM_NEON_TAB4(t), vshlq_n_s32(LM_NEON_I(t), 23 - LM_QBITS)))
/* the lane sums in double: 2 lanes, each the sum of two float lanes */
#define lmv_wide_t float64x2_t
#define lmv_wide_zero() vdupq_n_f64(0.0)
#define lmv_wide_add(w, v)                                                       \
    vaddq_f64(w, vaddq_f64(vcvt_f64_f32(vget_low_f32(v)), vcvt_high_f64_f32(v)))
#define lmv_wide_sum(w) (vgetq_lane_f64(w, 0) + vgetq_lane_f64(w, 1))
/* a where n is 0 or NaN, else b (|n| > 0 is false for both) */
#define lmv_sel_n0(n, a, b) vbslq_f32(vcagtq_f32(n, vdupq_n_f32(0.0f)), b, a)
/* nonzero when some lane of a equals the same lane of b */
#define lmv_any_eq(a, b) vmaxvq_u32(vceqq_f32(a, b))
/* x where y >= lo, else 0 (NaN in y: 0) */
#define lmv_zero_below(x, y, lo)                                                 \
    vreinterpretq_f32_u32(vandq_u32(vreinterpretq_u32_f32(x), vcgeq_f32(y, lo)))
/* the rank's count: lanes where x > t (ordered), added to int lanes */
#define lmv_cnt_t uint32x4_t
#define lmv_cnt_zero() vdupq_n_u32(0u)
#define lmv_cnt_gt(c, x, t) vsubq_u32(c, vcgtq_f32(x, t))
#define lmv_cnt_sum(c) ((int64_t)vaddvq_u32(c))

#define LM_LOAD2_F32(p, a, b)                                                  \
    do { a = vld1q_f32(p); b = vld1q_f32((p) + 4); } while (0)
#define LM_LANE_F32(k) (k)
#define LM_LOAD2_F16(p, a, b)                                                  \
    do {                                                                       \
        float16x8_t h_ = vreinterpretq_f16_u16(vld1q_u16((const uint16_t *)(p))); \
        a = vcvt_f32_f16(vget_low_f16(h_));                                    \
        b = vcvt_high_f32_f16(h_);                                             \
    } while (0)
#define LM_LANE_F16(k) (k)
/* 8 bf16 in one load: even elements by a shift, odd ones by a mask */
#define LM_LOAD2_BF16(p, a, b)                                                 \
    do {                                                                       \
        uint32x4_t x_ = vreinterpretq_u32_u16(vld1q_u16((const uint16_t *)(p))); \
        a = vreinterpretq_f32_u32(vshlq_n_u32(x_, 16));                        \
        b = vreinterpretq_f32_u32(vandq_u32(x_, vdupq_n_u32(0xffff0000u)));    \
    } while (0)
#define LM_LANE_BF16(k) ((k) < 4 ? 2 * (k) : 2 * ((k) - 4) + 1)
