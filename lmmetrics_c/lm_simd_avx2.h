/* AVX2 + FMA + F16C primitives for lm_body.h (8 float lanes). */
#ifndef LM_INTERNAL_H
#error "lm_simd_avx2.h is not a standalone header: lm_isa_avx2.c includes it after lm_internal.h"
#endif
#include <immintrin.h>

#define LM_ISA_TAG avx2
#define lmv_t __m256
#define LMV_LANE float
#define LMV_W 8
#define lmv_set1(x) _mm256_set1_ps((float)(x))
#define lmv_add _mm256_add_ps
#define lmv_sub _mm256_sub_ps
#define lmv_mul _mm256_mul_ps
#define lmv_div _mm256_div_ps
#define lmv_fma _mm256_fmadd_ps
/* a > b ? a : b: a NaN in b survives, a NaN in a is dropped */
#define lmv_max _mm256_max_ps
/* a < b ? a : b: a NaN in b survives */
#define lmv_min _mm256_min_ps
#define lmv_store _mm256_storeu_ps
#define lmv_loadu _mm256_loadu_ps
#define lmv_abs(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)
#define lmv_copysign(mag, s)                                                     \
    _mm256_or_ps(lmv_abs(mag), _mm256_and_ps(_mm256_set1_ps(-0.0f), s))
/* p * 2^n, n in [-125, 0] held in the low mantissa bits of t: add n to
 * p's exponent field */
#define lmv_scale(p, t)                                                          \
    _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p),               \
        _mm256_slli_epi32(_mm256_castps_si256(t), 23)))
/* 2^(n + j/8) for t holding 8n + j in its low bits (see LM_POW2Q_TABLE8):
 * one cross-lane permute of an 8-entry table (a cubic then suffices; with
 * 4 entries and an in-lane permute a quartic, its extra constants costing
 * AVX2's 16 registers more than the permute) */
#define LM_QBITS 3
#define lmv_pow2q(t)                                                             \
    _mm256_castsi256_ps(_mm256_add_epi32(                                      \
        _mm256_castps_si256(_mm256_permutevar8x32_ps(                          \
            _mm256_castsi256_ps(_mm256_setr_epi32(LM_POW2Q_TABLE8)),           \
            _mm256_castps_si256(t))),                                          \
        _mm256_slli_epi32(_mm256_castps_si256(t), 23 - LM_QBITS)))
/* the lane sums in double: 4 lanes, each the sum of two float lanes */
#define lmv_wide_t __m256d
#define lmv_wide_zero() _mm256_setzero_pd()
#define lmv_wide_add(w, v)                                                       \
    _mm256_add_pd(w, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(v)),  \
        _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))))
static inline double lm_avx2_wide_sum(__m256d w) {
    double t[4];
    _mm256_storeu_pd(t, w);
    return (t[0] + t[1]) + (t[2] + t[3]);
}
#define lmv_wide_sum lm_avx2_wide_sum
/* a where n is 0 or NaN, else b */
#define lmv_sel_n0(n, a, b)                                                      \
    _mm256_blendv_ps(b, a, _mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_EQ_UQ))
/* nonzero when some lane of a equals the same lane of b */
#define lmv_any_eq(a, b) _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ))
/* x where y >= lo, else 0 (NaN in y: 0) */
#define lmv_zero_below(x, y, lo) _mm256_and_ps(x, _mm256_cmp_ps(y, lo, _CMP_GE_OQ))
/* the rank's count: lanes where x > t (ordered), added to int lanes */
#define lmv_cnt_t __m256i
#define lmv_cnt_zero() _mm256_setzero_si256()
#define lmv_cnt_gt(c, x, t) _mm256_sub_epi32(c, _mm256_castps_si256(_mm256_cmp_ps(x, t, _CMP_GT_OQ)))
static inline int64_t lm_avx2_cnt_sum(__m256i c) {
    int32_t t[8];
    int64_t s = 0;
    _mm256_storeu_si256((__m256i *)t, c);
    for (int k = 0; k < 8; k++) s += t[k];
    return s;
}
#define lmv_cnt_sum lm_avx2_cnt_sum

#define LM_LOAD2_F32(p, a, b)                                                  \
    do { a = _mm256_loadu_ps(p); b = _mm256_loadu_ps((p) + 8); } while (0)
#define LM_LANE_F32(k) (k)
#define LM_LOAD2_F16(p, a, b)                                                  \
    do {                                                                       \
        a = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)));            \
        b = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((p) + 8)));      \
    } while (0)
#define LM_LANE_F16(k) (k)
/* 16 bf16 in one load: even elements by a shift, odd ones by a mask */
#define LM_LOAD2_BF16(p, a, b)                                                 \
    do {                                                                       \
        __m256i x_ = _mm256_loadu_si256((const __m256i *)(p));                 \
        a = _mm256_castsi256_ps(_mm256_slli_epi32(x_, 16));                    \
        b = _mm256_castsi256_ps(_mm256_and_si256(x_, _mm256_set1_epi32((int)0xffff0000u))); \
    } while (0)
#define LM_LANE_BF16(k) ((k) < 8 ? 2 * (k) : 2 * ((k) - 8) + 1)
