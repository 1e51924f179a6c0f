/* AVX2 + FMA primitives for lm_body.h in 4 double lanes: the float64
 * kernels (LM_EXP64: the body's double exp). lm_isa_avx2.c includes it
 * after lm_simd_avx2.h, whose float primitives it replaces. */
#ifndef LM_INTERNAL_H
#error "lm_simd_avx2_f64.h is not a standalone header: lm_isa_avx2.c includes it"
#endif
#include "lm_simd_undef.h"
#undef LMV_LANE

#define LM_EXP64 1
#define lmv_t __m256d
#define LMV_LANE double
#define LMV_W 4
#define lmv_set1(x) _mm256_set1_pd((double)(x))
#define lmv_add _mm256_add_pd
#define lmv_sub _mm256_sub_pd
#define lmv_mul _mm256_mul_pd
#define lmv_div _mm256_div_pd
#define lmv_fma _mm256_fmadd_pd
/* a > b ? a : b: a NaN in b survives, a NaN in a is dropped */
#define lmv_max _mm256_max_pd
#define lmv_min _mm256_min_pd
#define lmv_store _mm256_storeu_pd
#define lmv_loadu _mm256_loadu_pd
#define lmv_abs(x) _mm256_andnot_pd(_mm256_set1_pd(-0.0), x)
/* 2^(n + j/8) for t holding 8n + j in its low bits (see
 * LM_POW2Q64_TABLE8): AVX2 has no 64-bit variable permute, so each lane's
 * index goes to both of its 32-bit halves, two cross-lane 32-bit permutes
 * take the entries' low and high halves, and a blend joins them; n is
 * added into the exponent field */
#define LM_QBITS 3
static inline __m256d lm_avx2_pow2q_f64(__m256d t) {
    const __m256i ti = _mm256_castpd_si256(t);
    const __m256i idx = _mm256_shuffle_epi32(ti, 0xa0); /* dwords 0, 0, 2, 2 of each 128 bits */
    const __m256i lo = _mm256_permutevar8x32_epi32(_mm256_setr_epi32(LM_POW2Q64_TABLE8(LM_Q8D_LO)), idx);
    const __m256i hi = _mm256_permutevar8x32_epi32(_mm256_setr_epi32(LM_POW2Q64_TABLE8(LM_Q8D_HI)), idx);
    return _mm256_castsi256_pd(_mm256_add_epi64(_mm256_blend_epi32(lo, hi, 0xaa),
                                                _mm256_slli_epi64(ti, 52 - LM_QBITS)));
}
#define lmv_pow2q lm_avx2_pow2q_f64
/* the lane sums are double already: flushed into a second set of lanes */
#define lmv_wide_t __m256d
#define lmv_wide_zero() _mm256_setzero_pd()
#define lmv_wide_add _mm256_add_pd
#define lmv_wide_sum lm_avx2_wide_sum /* lm_simd_avx2.h */
/* nonzero when some lane of a equals the same lane of b */
#define lmv_any_eq(a, b) _mm256_movemask_pd(_mm256_cmp_pd(a, b, _CMP_EQ_OQ))
/* x where y >= lo, else 0 (NaN in y: 0) */
#define lmv_zero_below(x, y, lo) _mm256_and_pd(x, _mm256_cmp_pd(y, lo, _CMP_GE_OQ))
/* the rank's count: lanes where x > t (ordered), added to int lanes */
#define lmv_cnt_t __m256i
#define lmv_cnt_zero() _mm256_setzero_si256()
#define lmv_cnt_gt(c, x, t) _mm256_sub_epi64(c, _mm256_castpd_si256(_mm256_cmp_pd(x, t, _CMP_GT_OQ)))
static inline int64_t lm_avx2_cnt_sum64(__m256i c) {
    int64_t t[4];
    _mm256_storeu_si256((__m256i *)t, c);
    return t[0] + t[1] + t[2] + t[3];
}
#define lmv_cnt_sum lm_avx2_cnt_sum64

#define LM_LOAD2_F64(p, a, b)                                                  \
    do { a = _mm256_loadu_pd(p); b = _mm256_loadu_pd((p) + 4); } while (0)
#define LM_LANE_F64(k) (k)
