/* Portable primitives for lm_body.h: one lane of LMV_LANE (float, or double
 * with LM_LIBM_EXP for float64 input). Re-includable with another lane. */
#ifndef LM_INTERNAL_H
#error "lm_simd_scalar.h is not a standalone header: lm_isa_scalar.c includes it after lm_internal.h"
#endif
#include "lm_simd_undef.h"

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
#define lmv_t LMV_LANE
#define LMV_W 1
#define lmv_set1(x) ((LMV_LANE)(x))
#define lmv_add(a, b) ((a) + (b))
#define lmv_sub(a, b) ((a) - (b))
#define lmv_mul(a, b) ((a) * (b))
#define lmv_div(a, b) ((a) / (b))
/* Fused in the lane's own type where the target has an FMA unit (as the
 * vector paths). Elsewhere fma and fmaf are libm calls (x86-64's baseline:
 * 20-30 cycles a term), so float lanes compute a b + c in double: the
 * product of two floats is exact there, the add rounds to double, then to
 * float. In the exp's reduction (r = z - N ln2f / Q: 24-bit N times a
 * 24-bit constant, plus z) that sum is exact in double for z between
 * about 2^-29 and 2^20 in magnitude, so r is rounded once, as fused;
 * elsewhere the two roundings are within an ulp of one, which the
 * polynomial's interval absorbs. Double lanes (float64 input) take
 * a b + c, two roundings in double. */
#ifdef LM_LIBM_EXP
#ifdef FP_FAST_FMA
#define lmv_fma(a, b, c) fma(a, b, c)
#else
#define lmv_fma(a, b, c) ((a) * (b) + (c))
#endif
#elif defined(FP_FAST_FMAF)
#define lmv_fma(a, b, c) fmaf(a, b, c)
#else
#define lmv_fma(a, b, c) ((float)((double)(a) * (double)(b) + (double)(c)))
#endif
/* a > b ? a : b: a NaN in b survives, a NaN in a is dropped */
#define lmv_max(a, b) ((a) > (b) ? (a) : (b))
#define lmv_min(a, b) ((a) < (b) ? (a) : (b))
#define lmv_store(p, v) (*(p) = (v))
#define lmv_loadu(p) (*(p))
#define lmv_abs(x) ((LMV_LANE)fabs(x))
#define lmv_copysign(m, s) ((LMV_LANE)copysign(m, s))
#define lmv_scale(p, t) ((t) == (t) ? (LMV_LANE)ldexp(p, (int)((t) - LM_MAGIC)) : (t))
#undef LM_QBITS
#define LM_QBITS 5
#define lmv_pow2q(t) lm_pow2q(t)
/* a where n is 0 or NaN, else b */
#define lmv_sel_n0(n, a, b) ((n) < 0 || (n) > 0 ? (b) : (a))
#define lmv_any_eq(a, b) ((a) == (b))
#define lmv_zero_below(x, y, lo) ((y) >= (lo) ? (x) : (LMV_LANE)0)
/* the rank's count: lanes where x > t (ordered), added to int lanes */
#define lmv_cnt_t int64_t
#define lmv_cnt_zero() ((int64_t)0)
#define lmv_cnt_gt(c, x, t) ((c) + ((x) > (t)))
#define lmv_cnt_sum(c) (c)
/* one lane sums in double; a product of two floats is exact in double,
 * so that a plain add rounds once, like a fused one (and needs no libm
 * fma where the target has no FMA) */
#define lmv_acc_t double
#ifdef LM_LIBM_EXP
#define lmv_acc_fma(a, b, c) lmv_fma(a, b, c)
#else
#define lmv_acc_fma(a, b, c) ((c) + (double)(a) * (double)(b))
#endif
#define lmv_acc_sum(v) (v)

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
