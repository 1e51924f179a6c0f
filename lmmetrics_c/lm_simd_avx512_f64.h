/* AVX-512F primitives for lm_body.h in 8 double lanes: the float64
 * kernels (LM_EXP64: the body's double exp). lm_isa_avx512.c includes it
 * after lm_simd_avx512.h, whose float primitives it replaces. */
#ifndef LM_INTERNAL_H
#error "lm_simd_avx512_f64.h is not a standalone header: lm_isa_avx512.c includes it"
#endif
#include "lm_simd_undef.h"
#undef LMV_LANE

#define LM_EXP64 1
#define lmv_t __m512d
#define LMV_LANE double
#define LMV_W 8
#define lmv_set1(x) _mm512_set1_pd((double)(x))
#define lmv_add _mm512_add_pd
#define lmv_sub _mm512_sub_pd
#define lmv_mul _mm512_mul_pd
#define lmv_div _mm512_div_pd
#define lmv_fma _mm512_fmadd_pd
/* a > b ? a : b: a NaN in b survives, a NaN in a is dropped */
#define lmv_max _mm512_max_pd
#define lmv_min _mm512_min_pd
#define lmv_store _mm512_storeu_pd
#define lmv_loadu _mm512_loadu_pd
#define lmv_abs(x) _mm512_castsi512_pd(_mm512_and_si512(_mm512_castpd_si512(x),  \
    _mm512_set1_epi64(0x7fffffffffffffffll)))
/* 2^(n + j/8) for t holding 8n + j in its low bits (see
 * LM_POW2Q64_TABLE8): a one-register permute of the 8 entries, and n
 * added into the exponent field */
#define LM_QBITS 3
#define LM_SETR8D(...) _mm512_setr_epi64(__VA_ARGS__) /* expands the table first */
#define lmv_pow2q(t)                                                             \
    _mm512_castsi512_pd(_mm512_add_epi64(                                      \
        _mm512_castpd_si512(_mm512_permutexvar_pd(                             \
            _mm512_castpd_si512(t), _mm512_castsi512_pd(LM_SETR8D(LM_POW2Q64_TABLE8(LM_Q8D))))), \
        _mm512_slli_epi64(_mm512_castpd_si512(t), 52 - LM_QBITS)))
/* the lane sums are double already: flushed into a second set of lanes */
#define lmv_wide_t __m512d
#define lmv_wide_zero() _mm512_setzero_pd()
#define lmv_wide_add _mm512_add_pd
#define lmv_wide_sum(w) _mm512_reduce_add_pd(w)
/* nonzero when some lane of a equals the same lane of b */
#define lmv_any_eq(a, b) _mm512_cmp_pd_mask(a, b, _CMP_EQ_OQ)
/* x where y >= lo, else 0 (NaN in y: 0) */
#define lmv_zero_below(x, y, lo) _mm512_maskz_mov_pd(_mm512_cmp_pd_mask(y, lo, _CMP_GE_OQ), x)
/* the rank's count: lanes where x > t (ordered), added to int lanes */
#define lmv_cnt_t __m512i
#define lmv_cnt_zero() _mm512_setzero_si512()
#define lmv_cnt_gt(c, x, t) _mm512_mask_sub_epi64(c, _mm512_cmp_pd_mask(x, t, _CMP_GT_OQ), c, _mm512_set1_epi64(-1))
#define lmv_cnt_sum(c) ((int64_t)_mm512_reduce_add_epi64(c))

#define LM_LOAD2_F64(p, a, b)                                                  \
    do { a = _mm512_loadu_pd(p); b = _mm512_loadu_pd((p) + 8); } while (0)
#define LM_LANE_F64(k) (k)
