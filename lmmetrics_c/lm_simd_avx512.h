/* AVX-512F + BW primitives for lm_body.h (16 float lanes). */
#ifndef LM_INTERNAL_H
#error "lm_simd_avx512.h is not a standalone header: lm_isa_avx512.c includes it after lm_internal.h"
#endif
#include <immintrin.h>

#define LM_ISA_TAG avx512
#define lmv_t __m512
#define LMV_LANE float
#define LMV_W 16
#define lmv_set1(x) _mm512_set1_ps((float)(x))
#define lmv_add _mm512_add_ps
#define lmv_sub _mm512_sub_ps
#define lmv_mul _mm512_mul_ps
#define lmv_div _mm512_div_ps
#define lmv_fma _mm512_fmadd_ps
/* a > b ? a : b: a NaN in b survives, a NaN in a is dropped */
#define lmv_max _mm512_max_ps
/* a < b ? a : b: a NaN in b survives */
#define lmv_min _mm512_min_ps
#define lmv_store _mm512_storeu_ps
#define lmv_loadu _mm512_loadu_ps
#define lmv_abs(x) _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x),  \
    _mm512_set1_epi32(0x7fffffff)))
#define lmv_copysign(mag, s) _mm512_castsi512_ps(_mm512_or_si512(                \
    _mm512_castps_si512(lmv_abs(mag)), _mm512_and_si512(_mm512_castps_si512(s),  \
    _mm512_set1_epi32((int)0x80000000u))))
/* p * 2^n, n in [-125, 0] held in the low mantissa bits of t: add n to
 * p's exponent field */
#define lmv_scale(p, t)                                                          \
    _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(p),               \
        _mm512_slli_epi32(_mm512_castps_si512(t), 23)))
/* 2^(n + j/16) for t holding 16n + j in its low bits (see
 * LM_POW2Q_TABLE16): a one-register permute looks up all 16 entries, and
 * a cubic then errs below float's rounding (32 entries would take a
 * two-register permute, about 10% more cycles a vector on Zen 4) */
#define LM_QBITS 4
#define LM_SETR16(...) _mm512_setr_epi32(__VA_ARGS__) /* expands the table first */
#define lmv_pow2q(t)                                                             \
    _mm512_castsi512_ps(_mm512_add_epi32(                                      \
        _mm512_castps_si512(_mm512_permutexvar_ps(                             \
            _mm512_castps_si512(t), _mm512_castsi512_ps(LM_SETR16(LM_POW2Q_TABLE16)))), \
        _mm512_slli_epi32(_mm512_castps_si512(t), 23 - LM_QBITS)))
/* 16-bit dtypes take a block's max on the raw bits (one signed 16-bit max
 * per 32 elements; see LM_RAWMAX in lm_body.h) */
typedef __m512i lmv_i16_t;
#define lmv_imax16_init() _mm512_set1_epi16(-32768)
#define lmv_imax16(acc, p) _mm512_max_epi16(acc, _mm512_loadu_si512((const void *)(p)))
#define lmv_imax16_store(p, v) _mm512_storeu_si512((void *)(p), v)
/* the lane sums in double: 8 lanes, each the sum of two float lanes */
#define lmv_wide_t __m512d
#define lmv_wide_zero() _mm512_setzero_pd()
#define lmv_wide_add(w, v)                                                       \
    _mm512_add_pd(w, _mm512_add_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(v)),  \
        _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))))
#define lmv_wide_sum(w) _mm512_reduce_add_pd(w)
/* a where n is 0 or NaN, else b */
#define lmv_sel_n0(n, a, b)                                                      \
    _mm512_mask_blend_ps(_mm512_cmp_ps_mask(n, _mm512_setzero_ps(), _CMP_EQ_UQ), b, a)
/* nonzero when some lane of a equals the same lane of b */
#define lmv_any_eq(a, b) _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ)
/* x where y >= lo, else 0 (NaN in y: 0) */
#define lmv_zero_below(x, y, lo) _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(y, lo, _CMP_GE_OQ), x)
/* the rank's count: lanes where x > t (ordered): the compare's mask
 * counted by popcnt, off the vector pipes (a masked integer subtract into
 * int lanes, one more vector operation, measured 1.15x the NLL's time on
 * one Zen 4 thread against 1.09-1.13x this way) */
#define lmv_cnt_t int64_t
#define lmv_cnt_zero() ((int64_t)0)
#define lmv_cnt_gt(c, x, t) ((c) + LM_POPCNT32(_mm512_cmp_ps_mask(x, t, _CMP_GT_OQ)))
#define lmv_cnt_sum(c) (c)

#define LM_LOAD2_F32(p, a, b)                                                  \
    do { a = _mm512_loadu_ps(p); b = _mm512_loadu_ps((p) + 16); } while (0)
#define LM_LANE_F32(k) (k)
#define LM_LOAD2_F16(p, a, b)                                                  \
    do {                                                                       \
        a = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)));         \
        b = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((p) + 16)));  \
    } while (0)
#define LM_LANE_F16(k) (k)
/* 32 bf16 in one load: even elements by a shift, odd ones by a mask */
#define LM_LOAD2_BF16(p, a, b)                                                 \
    do {                                                                       \
        __m512i x_ = _mm512_loadu_si512((const void *)(p));                    \
        a = _mm512_castsi512_ps(_mm512_slli_epi32(x_, 16));                    \
        b = _mm512_castsi512_ps(_mm512_and_si512(x_, _mm512_set1_epi32((int)0xffff0000u))); \
    } while (0)
#define LM_LANE_BF16(k) ((k) < 16 ? 2 * (k) : 2 * ((k) - 16) + 1)
