/* Portable primitives for lm_body.h: one lane of LANE_T (float, or double
 * with LM_LIBM_EXP for float64 input). Re-includable with another lane. */
#ifndef LM_INTERNAL_H
#error "lm_simd_scalar.h is not a standalone header: lm_isa_scalar.c includes it after lm_internal.h"
#endif
#undef VW
#undef v_set1
#undef v_add
#undef v_sub
#undef v_mul
#undef v_div
#undef v_fma
#undef v_max
#undef v_store
#undef v_abs
#undef v_copysign
#undef v_scale
#undef v_pow2q
#undef v_sel_n0
#undef v_zero_below
#undef v_loadu
#undef v_any_eq

#ifndef LM_SIMD_SCALAR_ONCE
#define LM_SIMD_SCALAR_ONCE
/* 2^(n + j/32) for t holding 32n + j in its low bits (see
 * LM_POW2Q_TABLE32_LO), by the same integer steps as the vector paths */
static inline float lm_pow2q(float t) {
    static const int32_t tab[32] = {LM_POW2Q_TABLE32_LO, LM_POW2Q_TABLE32_HI};
    uint32_t u;
    memcpy(&u, &t, 4);
    u = (uint32_t)tab[u & 31u] + (u << 18);
    memcpy(&t, &u, 4);
    return t;
}
#endif

#define LM_ISA_TAG scalar
#define VF LANE_T
#define VW 1
#define v_set1(x) ((LANE_T)(x))
#define v_add(a, b) ((a) + (b))
#define v_sub(a, b) ((a) - (b))
#define v_mul(a, b) ((a) * (b))
#define v_div(a, b) ((a) / (b))
/* fused in the lane's own type, as the vector paths' (the sums' exp
 * relies on one rounding; fma in double, then to float, rounds twice) */
#ifdef LM_LIBM_EXP
#define v_fma(a, b, c) fma(a, b, c)
#else
#define v_fma(a, b, c) fmaf(a, b, c)
#endif
/* a > b ? a : b: a NaN in b survives, a NaN in a is dropped */
#define v_max(a, b) ((a) > (b) ? (a) : (b))
#define v_store(p, v) (*(p) = (v))
#define v_loadu(p) (*(p))
#define v_abs(x) ((LANE_T)fabs(x))
#define v_copysign(m, s) ((LANE_T)copysign(m, s))
#define v_scale(p, t) ((t) == (t) ? (LANE_T)ldexp(p, (int)((t) - LM_MAGIC)) : (t))
#undef LM_QBITS
#define LM_QBITS 5
#define v_pow2q(t) lm_pow2q(t)
#define v_sel_n0(n, a, b) ((n) == 0 ? (a) : (b))
#define v_any_eq(a, b) ((a) == (b))
#define v_zero_below(x, y, lo) ((y) >= (lo) ? (x) : (LANE_T)0)

#define LM_LOAD2_F32(p, a, b) do { a = (p)[0]; b = (p)[1]; } while (0)
#define LM_LANE_F32(k) (k)
#define LM_LOAD2_F16(p, a, b)                                                  \
    do { a = lm_f16_to_float((p)[0]); b = lm_f16_to_float((p)[1]); } while (0)
#define LM_LANE_F16(k) (k)
#define LM_LOAD2_BF16(p, a, b)                                                 \
    do { a = lm_bf16_to_float((p)[0]); b = lm_bf16_to_float((p)[1]); } while (0)
#define LM_LANE_BF16(k) (k)
#define LM_LOAD2_F64(p, a, b) do { a = (p)[0]; b = (p)[1]; } while (0)
#define LM_LANE_F64(k) (k)
