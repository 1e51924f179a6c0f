/* The one kernel body: a segment of a row (or of a row pair, for KL) in one
 * pass over memory. lm_instantiate.h includes it once per (ISA, dtype),
 * after an lm_simd_*.h header has defined the vector primitives
 *   lmv_t (a vector of LMV_W lanes of LMV_LANE), lmv_set1, lmv_add, lmv_sub,
 *   lmv_mul, lmv_div, lmv_fma (fused), lmv_max, lmv_min, lmv_abs, lmv_copysign,
 *   lmv_scale, lmv_pow2q, lmv_sel_n0, lmv_zero_below, lmv_any_eq, lmv_store,
 *   lmv_loadu, lmv_cnt_t, lmv_cnt_zero, lmv_cnt_gt, lmv_cnt_sum (the rank's
 *   count of lanes above a value, in int lanes; the rank's ties need no
 *   primitive of their own [README: rank]) (and optionally lmv_i16_t and lmv_imax16*, and lmv_acc_t,
 *   lmv_acc_fma, lmv_acc_sum: the lane sums' type, lmv_t by default),
 * and the dtype macros
 *   LM_ELEM            the storage type, LM_ELEM_NEGINF its -inf,
 *   LM_LOAD2(p, a, b)  load 2*LMV_W elements into two vectors (any lane order),
 *   LM_LANE_ELEM(k)    the element offset of lane position k in [a, b],
 *   LM_FN(name)        this instantiation's name for `name`.
 *
 * How the pass works, and why each trick is exact enough, is in
 * lmmetrics_c/README.md; the sections named [README: ...] below point to
 * its paragraphs. In short: the segment is walked in blocks; one loop takes
 * a block's max and its sums of exp(z - shift), the shift a multiple of
 * ln 2 at or above the max of the blocks before; a block whose max passes
 * the max before it by more than LM_HEAD is done again, from L1, against
 * the new shift [README: the pass]. Float lane sums are flushed to double
 * lanes every few steps (LM_FLUSH).
 */

#define LM_STEP (2 * LMV_W)
/* block length: at most LM_BLOCK elements and 64 steps, 32 in the KL
 * pass (the lane sums go to double every LM_FLUSH steps) */
#define LM_BLK (64 * LM_STEP < LM_BLOCK ? 64 * LM_STEP : LM_BLOCK)

#ifndef LM_BODY_ONCE
#define LM_BODY_ONCE
#define LM_INLINE LM_ALWAYS_INLINE /* lm_port.h */

/* One side's running state in a segment (the model's logits, or the
 * reference's). */
typedef struct {
    double max;    /* the max so far; -inf before any value above -inf */
    double shift;  /* the sums are of e = exp(z - shift); -inf likewise */
    double sum;    /* sum e */
    double dsum;   /* sum e (z - shift) (the model side, for entropy) */
    int64_t block; /* the block of the last rise of max (the argmax is there) */
} lm_side;

/* Move a side's sums to the shift `to` (above its shift): each e becomes
 * a e, a = exp(shift - to), and each (z - shift) drops by (to - shift);
 * *wsum, a sum of e times such a difference, follows. */
LM_INLINE void lm_reshift(lm_side *sd, double *wsum, double to) {
    if (sd->sum != 0.0) {
        double a = exp(sd->shift - to);
        if (wsum) *wsum = a * (*wsum + (sd->shift - to) * sd->sum);
        sd->sum *= a;
    }
    sd->shift = to;
}

/* the shift a block is computed against: 0 while a side has none (its
 * sums are then dropped; the pass still looks for NaN) */
LM_INLINE double lm_effective(double shift) { return shift == -INFINITY ? 0.0 : shift; }
#endif /* LM_BODY_ONCE */

/* ------------------------------------------------------------ exp, softcap */

/* The softcap's constants in the lanes [README: softcap]: c and 1 / c
 * each as a sum hi + lo of two lane values (float lanes: a single rounded
 * constant would scale every capped logit by the same 1 + 6e-8, a bias
 * the summed NLL sees), and 64 c, past which tanh is 1 in float. */
typedef struct { lmv_t c, c_lo, ic, ic_lo, big; } LM_FN(cap_t);

LM_INLINE LM_FN(cap_t) LM_FN(cap_of_)(double c) {
    LM_FN(cap_t) k;
    const double ic = 1.0 / c;
    k.c = lmv_set1((LMV_LANE)c);
    k.c_lo = lmv_set1((LMV_LANE)(c - (double)(LMV_LANE)c));
    k.ic = lmv_set1((LMV_LANE)ic);
    k.ic_lo = lmv_set1((LMV_LANE)(ic - (double)(LMV_LANE)ic));
    k.big = lmv_set1((LMV_LANE)(64.0 * c));
    return k;
}

#if defined(LM_LIBM_EXP) || defined(LM_EXP64) /* double lanes [README: float64] */
/* the shift is the max itself (shift_of_), and fix_ has nothing to fix */
#define LM_SHIFT_IS_MAX 1
/* softcap: libm's tanh in double, lane by lane (float64 with a softcap is
 * rare; the float lanes' expm1 would not be accurate enough here) */
LM_INLINE lmv_t LM_FN(cap_)(lmv_t x, const LM_FN(cap_t) *k) {
    LMV_LANE v[LMV_W], c[LMV_W];
    lmv_store(v, x);
    lmv_store(c, k->c);
    for (int i = 0; i < LMV_W; i++) v[i] = lm_softcap(v[i], c[0]);
    return lmv_loadu(v);
}
/* the lane value of expq_'s second argument for a shift */
LM_INLINE lmv_t LM_FN(expq_arg_)(double shift) { return lmv_set1(shift); }
#endif

#ifdef LM_LIBM_EXP /* one double lane: libm */
#define LM_EXP_LO (-746.0)
/* e^(z - shift) = p * sc */
LM_INLINE lmv_t LM_FN(expq_)(lmv_t z, lmv_t shift, lmv_t *sc) { *sc = 1.0; return exp(z - shift); }
#elif defined(LM_EXP64) /* double vector lanes [README: float64] */
/* terms below e^-700 of the shift count as e^-700 (2^-1010: sc stays a
 * normal double); nothing against a sum of at least 1 */
#define LM_EXP_LO (-700.0)
/* e^(z - shift) = p * sc for z in [shift + LM_EXP_LO, shift + LM_HEAD]:
 * x = z - shift, t = Q x / ln2 + MAGIC64 holds N = round(Q x / ln2) in its
 * low bits, r = x - N ln2 / Q (one rounding, |r| <= ln2 / 2Q), sc =
 * 2^(N / Q) from the table and the exponent field (lmv_pow2q, Q = 8) and
 * p = e^r by a degree-6 polynomial with 1 + r its first terms (e^0 exact),
 * minimax for relative error over |r| <= ln2 / 16: 1.5e-15, before the
 * roundings of the evaluation (a few 1e-16). ln 2 rounded to double adds
 * below 3.3e-17 |x| to r, less than x's own rounding. NaN in z gives a NaN
 * p. */
LM_INLINE lmv_t LM_FN(expq_)(lmv_t z, lmv_t shift, lmv_t *sc) {
    const lmv_t x = lmv_sub(z, shift);
    const lmv_t t = lmv_fma(x, lmv_set1((1 << LM_QBITS) * 1.4426950408889634), lmv_set1(LM_MAGIC64));
    const lmv_t r = lmv_fma(lmv_sub(t, lmv_set1(LM_MAGIC64)),
                            lmv_set1(-0.6931471805599453 / (1 << LM_QBITS)), x);
    lmv_t p = lmv_fma(lmv_set1(0.0013887709776968936), r, lmv_set1(0.008333887664001088));
    *sc = lmv_pow2q(t);
    p = lmv_fma(p, r, lmv_set1(0.0416666670919471));
    p = lmv_fma(p, r, lmv_set1(0.16666666630691587));
    p = lmv_fma(p, r, lmv_set1(0.4999999999997468));
    p = lmv_fma(p, r, lmv_set1(1.0));
    return lmv_fma(p, r, lmv_set1(1.0));
}
#else
#define LM_EXP_LO (-86.0f)
/* e^r - 1 = r + r^2 D(r), D = (e^r - 1 - r) / r^2 by a degree-4
 * polynomial fitted for relative error over [-ln2/2, ln2/2] (expm1 within
 * 9e-8 relative in float, no bias near 0), by Estrin's scheme. Used by the
 * softcap, whose tanh needs expm1 accurate near 0 [README: softcap]. */
LM_INLINE lmv_t LM_FN(exp_d_)(lmv_t r, lmv_t r2) {
    lmv_t hi = lmv_fma(lmv_set1(0.001390127930790186f), r2,
                       lmv_fma(lmv_set1(0.008363140746951103f), r, lmv_set1(0.04166685417294502f)));
    return lmv_fma(hi, r2, lmv_fma(lmv_set1(0.16666577756404877f), r, lmv_set1(0.5f)));
}
/* Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, for x in
 * [LM_EXP_LO, 0]: sets t (n in its low bits), r and r^2, returns D(r), so
 * that e^r = 1 + r + r^2 D(r). */
LM_INLINE lmv_t LM_FN(reduce_)(lmv_t x, lmv_t *t, lmv_t *r, lmv_t *r2) {
    *t = lmv_fma(x, lmv_set1(1.44269504088896341f), lmv_set1(LM_MAGIC));
    *r = lmv_fma(lmv_sub(*t, lmv_set1(LM_MAGIC)), lmv_set1(-0.69314718055994531f), x);
    *r2 = lmv_mul(*r, *r);
    return LM_FN(exp_d_)(*r, *r2);
}
/* softcap: c tanh(x / c) = sign(x) c (-em1 / (2 + em1)), em1 =
 * expm1(-2|x|/c), accurate near 0 (for n == 0 em1 is q itself)
 * [README: softcap]. |x| is first clamped to 64 c (operand order keeps a
 * NaN), so that |x| / c = |x| ic + |x| ic_lo never meets inf * 0. */
LM_INLINE lmv_t LM_FN(cap_)(lmv_t x, const LM_FN(cap_t) *k) {
    lmv_t a = lmv_min(k->big, lmv_abs(x));
    lmv_t u = lmv_fma(a, k->ic, lmv_mul(a, k->ic_lo));
    lmv_t y = lmv_max(lmv_set1(LM_EXP_LO), lmv_mul(u, lmv_set1(-2.0f)));
    lmv_t t, r, r2, d = LM_FN(reduce_)(y, &t, &r, &r2);
    lmv_t q = lmv_fma(d, r2, r);                         /* e^r - 1 */
    /* n == 0: q itself; NaN (x NaN) too: lmv_scale's integer add would
     * carry a NaN's low payload bits into its sign and exponent, a finite
     * value (0x7f800001 capped to c), a NaN the pass no longer sees */
    lmv_t em1 = lmv_sel_n0(lmv_sub(t, lmv_set1(LM_MAGIC)), q,
                      lmv_sub(lmv_scale(lmv_add(q, lmv_set1(1.0f)), t), lmv_set1(1.0f)));
    lmv_t tnh = lmv_div(lmv_sub(lmv_set1(0.0f), em1), lmv_add(em1, lmv_set1(2.0f)));
    return lmv_copysign(lmv_fma(tnh, k->c, lmv_mul(tnh, k->c_lo)), x);
}
/* The sums' exp [README: the exp]: e^(z - K ln2f) = p * sc for z in
 * [shift + LM_EXP_LO, shift + LM_HEAD], shift = K ln2f, with no subtraction
 * of the shift: c1 = MAGIC - QK (expq_arg_), t = Q z / ln2 + c1 holds
 * N - QK in its low bits, N = round(Q z / ln2); r = z - N ln2f / Q (one
 * fused rounding, |r| <= ln2 / 2Q); e^r by a polynomial and sc =
 * 2^((N - QK) / Q) from the table and the exponent field (lmv_pow2q).
 * Q = 2^LM_QBITS (the ISA's choice): 4, a quartic (4.4e-9 relative); 8, a
 * cubic (2.7e-8); 16, a cubic (1.6e-9); 32, a cubic (1e-10); each fitted
 * for relative error with 1 + r its first terms where it could be (e^0
 * exact), before the result's rounding (3e-8). Not less: where many terms
 * share a value (a flat row, a fresh model's) their errors add up instead
 * of averaging out [README: the exp]. NaN in z gives a NaN p. */
#define LM_Q (1 << LM_QBITS)
LM_INLINE lmv_t LM_FN(expq_)(lmv_t z, lmv_t c1, lmv_t *sc) {
    lmv_t t = lmv_fma(z, lmv_set1(LM_Q * 1.44269504088896341f), c1); /* Q / ln 2 */
    lmv_t r = lmv_fma(lmv_sub(t, c1), lmv_set1(-LM_LN2F / LM_Q), z);    /* ln2f / Q, exact */
    *sc = lmv_pow2q(t);
#if LM_QBITS >= 5
    return lmv_fma(lmv_fma(lmv_fma(lmv_set1(0.16666518f), r, lmv_set1(0.50000405f)), r,
                           lmv_set1(1.0f)), r, lmv_set1(1.0f));
#elif LM_QBITS == 4
    return lmv_fma(lmv_fma(lmv_fma(lmv_set1(0.16666074f), r, lmv_set1(0.5000162f)), r,
                           lmv_set1(1.0f)), r, lmv_set1(1.0f));
#elif LM_QBITS == 3
    return lmv_fma(lmv_fma(lmv_fma(lmv_set1(0.16664298f), r, lmv_set1(0.5000648f)), r,
                           lmv_set1(1.0f)), r, lmv_set1(1.0f));
#else
    return lmv_fma(lmv_fma(lmv_fma(lmv_fma(lmv_set1(0.041658282f), r, lmv_set1(0.16674428f)), r,
                                   lmv_set1(0.5000001f)), r, lmv_set1(0.9999999f)),
                   r, lmv_set1(1.0f));
#endif
}
LM_INLINE lmv_t LM_FN(expq_arg_)(double shift) {
    return lmv_set1(LM_MAGIC - (float)(LM_Q * shift / LM_LN2F));
}
#endif

/* A block whose max passes the max before it by more than this is done
 * again against the new shift [README: the redo rule]. */
#define LM_HEAD 1.0
/* |K| bound for c1 = MAGIC - QK to stay exact: rows whose maxima pass
 * +-2^21 ln2 / Q (3.6e5 for Q = 4, 1.8e5 for Q = 8, 9.1e4 for Q = 16, 4.5e4 for Q = 32) take
 * the exact path. */
#define LM_KMAX (2097152.0 / LM_Q)
/* In double lanes (float64 input) the shift is the max itself; rows whose
 * maxima pass +-2^50 take the exact path (beyond, the clamp shift +
 * LM_EXP_LO would round to the shift and every term count as the max's). */
#define LM_F64_MAX 1125899906842624.0
/* The KL cross term adds e_r d, d = (r - ref max) - (z - max), both
 * unclamped [README: the cross term]. A lane whose r lies below the clamp
 * adds nothing: its true e_r d is below exp(LM_EXP_LO) |d|, nil while
 * |d| <= LM_CROSS_BIG. A block where some d passes LM_CROSS_BIG (the model
 * masks, with -inf or a finite value, where the reference does not) sends
 * the row to the exact path, which also keeps float sums from overflowing. */
#define LM_CROSS_BIG 1e20

/* ---------------------------------------------------------------- loading */

/* How stored elements become lane values: the softcap c tanh(z / c) when
 * it is on and, in the tail (valid < LM_STEP real elements, the rest
 * padding), the padding set to -inf after the cap, so that it adds nothing
 * in any mode (capped, -inf padding would be -c: a value like any other). */
typedef struct { LM_FN(cap_t) k; int capped; int64_t valid; } LM_FN(loader_t);

LM_INLINE LM_FN(loader_t) LM_FN(loader_)(int capped, double cap, int64_t valid) {
    LM_FN(loader_t) ld;
    ld.k = LM_FN(cap_of_)(capped ? cap : 1.0);
    ld.capped = capped;
    ld.valid = valid;
    return ld;
}

LM_INLINE void LM_FN(unpad_)(lmv_t *a, lmv_t *b, int64_t valid) {
    LMV_LANE tmp[LM_STEP];
    lmv_store(tmp, *a);
    lmv_store(tmp + LMV_W, *b);
    for (int k = 0; k < LM_STEP; k++)
        if (LM_LANE_ELEM(k) >= valid) tmp[k] = (LMV_LANE)-INFINITY;
    *a = lmv_loadu(tmp);
    *b = lmv_loadu(tmp + LMV_W);
}

LM_INLINE void LM_FN(load_)(const LM_ELEM *p, const LM_FN(loader_t) ld, lmv_t *a, lmv_t *b) {
    LM_LOAD2(p, *a, *b);
    if (ld.capped) {
        *a = LM_FN(cap_)(*a, &ld.k);
        *b = LM_FN(cap_)(*b, &ld.k);
        if (ld.valid < LM_STEP) LM_FN(unpad_)(a, b, ld.valid);
    }
}

/* ------------------------------------------------------ maxima, argmax */

LM_INLINE LMV_LANE LM_FN(hmax_)(lmv_t v) {
    LMV_LANE tmp[LMV_W], m;
    lmv_store(tmp, v);
    m = tmp[0];
    for (int k = 1; k < LMV_W; k++) m = tmp[k] > m ? tmp[k] : m;
    return m;
}

LM_INLINE double LM_FN(hsum_)(lmv_t v) {
    LMV_LANE tmp[LMV_W];
    double s = 0.0;
    lmv_store(tmp, v);
    for (int k = 0; k < LMV_W; k++) s += (double)tmp[k];
    return s;
}

/* max over len elements (len a multiple of LM_STEP); NaN is skipped here and
 * caught by the exp pass. */
LM_INLINE LMV_LANE LM_FN(max_)(const LM_ELEM *z, int64_t len, const LM_FN(loader_t) ld) {
    lmv_t m0 = lmv_set1(-INFINITY), m1 = m0;
    for (int64_t j = 0; j < len; j += LM_STEP) {
        lmv_t a, b;
        LM_FN(load_)(z + j, ld, &a, &b);
        m0 = lmv_max(a, m0);
        m1 = lmv_max(b, m1);
    }
    return LM_FN(hmax_)(lmv_max(m0, m1));
}

/* first index in [0, len) whose (capped) value equals bm: a vector test
 * per step, a lane scan only in the step that holds it */
LM_INLINE int64_t LM_FN(find_)(const LM_ELEM *z, int64_t len, LMV_LANE bm, const LM_FN(loader_t) ld) {
    const lmv_t vbm = lmv_set1(bm);
    for (int64_t j = 0; j < len; j += LM_STEP) {
        lmv_t a, b;
        LMV_LANE tmp[LM_STEP];
        int64_t best = -1;
        LM_FN(load_)(z + j, ld, &a, &b);
        if (!(lmv_any_eq(a, vbm) || lmv_any_eq(b, vbm))) continue;
        lmv_store(tmp, a);
        lmv_store(tmp + LMV_W, b);
        for (int k = 0; k < LM_STEP; k++)
            if (tmp[k] == bm && (best < 0 || LM_LANE_ELEM(k) < best)) best = LM_LANE_ELEM(k);
        if (best >= 0) return j + best;
    }
    return 0;
}

#if LM_RAW16 && defined(lmv_imax16)
#define LM_RAWMAX 1
/* A 16-bit block's max from the signed 16-bit max of its raw bits (one
 * integer max a vector instead of a float max per half): exact when that
 * is a number >= +0, sign-magnitude ordering like the integers there. A
 * block of negative numbers only, or holding a positive NaN, takes the
 * float max again, from L1. */
LM_INLINE LMV_LANE LM_FN(rawmax_)(lmv_i16_t acc, const LM_ELEM *z, int64_t len) {
    int16_t tmp[sizeof(lmv_i16_t) / 2];
    int m = -32768;
    lmv_imax16_store(tmp, acc);
    for (int k = 0; k < (int)(sizeof(lmv_i16_t) / 2); k++) m = tmp[k] > m ? tmp[k] : m;
    if (m >= 0 && m <= LM_ELEM_POSINF) return LM_ELEM_TO_FLOAT((uint16_t)m);
    return LM_FN(max_)(z, len, LM_FN(loader_)(0, 1.0f, LM_STEP));
}
#else
#define LM_RAWMAX 0
#endif

/* ------------------------------------------------------------- one block */

/* Where a block prefetches (the data a fixed distance ahead): step j's
 * elements lie at in + j elements while j < cut (in the segment), at
 * out + j past it (the segment after it, or the next row's). Addresses are
 * integers: they may pass a buffer's ends, which a prefetch may do and
 * pointer arithmetic may not. */
typedef struct { uintptr_t in, out; int64_t cut; } LM_FN(ahead_t);

/* Prefetch the bytes step j of a block reads, at base + j elements: each
 * LM_LINE-byte line once, for any step size (a step of 128 bytes spans two
 * lines, one of 32 bytes half a line). */
LM_INLINE void LM_FN(prefetch_)(uintptr_t base, int64_t j) {
    const int64_t bytes = LM_STEP * (int64_t)sizeof(LM_ELEM), at = j * (int64_t)sizeof(LM_ELEM);
    if (bytes >= LM_LINE) {
        for (int64_t q = 0; q < bytes; q += LM_LINE) LM_PREFETCH(base + (uintptr_t)(at + q));
    } else if (at % LM_LINE == 0) {
        LM_PREFETCH(base + (uintptr_t)at);
    }
}

/* What a block's terms need: per side the clamp (shift + LM_EXP_LO),
 * expq_'s argument for the shift, and the lane max that d = z - max is
 * formed against (the max so far: a one-hot row's d is then 0). */
typedef struct { lmv_t lo, arg, lane_max; } LM_FN(terms_t);

/* The lane sums' type: the vector's own, unless the ISA header names one
 * (the portable path's single lane sums in double: one float lane would
 * take every term of a row [README: accuracy]). */
#ifndef lmv_acc_t
#define lmv_acc_t lmv_t
#define lmv_acc_fma lmv_fma
#define lmv_acc_sum(v) LM_FN(hsum_)(v)
#endif
/* Where the lane sums go every LM_FLUSH steps: lmv_wide_t, the lanes'
 * sums in double (an ISA header's own: its lanes widened and added; by
 * default one double, the lanes' sum). */
#ifndef lmv_wide_t
#define lmv_wide_t double
#define lmv_wide_zero() 0.0
#define lmv_wide_add(w, v) ((w) + lmv_acc_sum(v))
#define lmv_wide_sum(w) (w)
#endif
/* float lane sums take 2 LM_FLUSH terms (2 LM_FLUSH_REF in the KL pass),
 * then go to double: where many terms are equal each add rounds the same
 * way, and a lane that holds a large term rounds every small one on its
 * grid, the error growing with the terms a lane takes [README: accuracy] */
#define LM_FLUSH 8
#define LM_FLUSH_REF 2

/* The lane sums of a block: sum e, sum e d, the reference's sum e_r
 * and cross term sum e_r (d_r - d), the maxima, and the largest cross
 * difference (see LM_CROSS_BIG); and the sums so far in double. */
typedef struct {
    lmv_acc_t sum, dsum, ref_sum, cross;
    lmv_t max, ref_max, cross_max;
    lmv_wide_t wsum, wdsum, wref_sum, wcross;
} LM_FN(lanes_t);

/* the lane sums into the double ones, and from 0 again */
LM_INLINE void LM_FN(flush_)(LM_FN(lanes_t) *a, const int ent, const int ref) {
    const lmv_acc_t zero = lmv_set1(0.0f);
    a->wsum = lmv_wide_add(a->wsum, a->sum);
    a->sum = zero;
    if (ent) { a->wdsum = lmv_wide_add(a->wdsum, a->dsum); a->dsum = zero; }
    if (ref) {
        a->wref_sum = lmv_wide_add(a->wref_sum, a->ref_sum);
        a->wcross = lmv_wide_add(a->wcross, a->cross);
        a->ref_sum = a->cross = zero;
    }
}

LM_INLINE LM_FN(terms_t) LM_FN(terms_)(double shift, LMV_LANE lane_max) {
    LM_FN(terms_t) k;
    k.lo = lmv_set1((LMV_LANE)(shift + LM_EXP_LO));
    k.arg = LM_FN(expq_arg_)(shift);
    k.lane_max = lmv_set1(lane_max);
    return k;
}

/* One vector x of the model (and y of the reference) into the lane sums:
 * max, clamp (a NaN survives it), e = p sc, sum += p sc fused (the same in
 * every mode). Each vector is done before the next, to keep few values
 * live. */
LM_INLINE void LM_FN(term_)(lmv_t x, lmv_t y, const LM_FN(terms_t) *kz, const LM_FN(terms_t) *kr,
                             const int ent, const int ref, const int track_max, LM_FN(lanes_t) *a) {
    lmv_t xc = lmv_max(kz->lo, x), sc, p;
    if (track_max) a->max = lmv_max(x, a->max);
    p = LM_FN(expq_)(xc, kz->arg, &sc);
    a->sum = lmv_acc_fma(p, sc, a->sum);
    if (ent) a->dsum = lmv_acc_fma(lmv_mul(p, sc), lmv_sub(xc, kz->lane_max), a->dsum);
    if (ref) {
        lmv_t yc = lmv_max(kr->lo, y), d;
        if (track_max) a->ref_max = lmv_max(y, a->ref_max);
        p = LM_FN(expq_)(yc, kr->arg, &sc);
        a->ref_sum = lmv_acc_fma(p, sc, a->ref_sum);
        d = lmv_sub(lmv_sub(y, kr->lane_max), lmv_sub(x, kz->lane_max));
        a->cross_max = lmv_max(d, a->cross_max);
        a->cross = lmv_acc_fma(lmv_mul(p, sc), lmv_zero_below(d, y, kr->lo), a->cross);
    }
}

/* What one block gives, in double: its sums against the shifts it was
 * given (sum, dsum, ref_sum, cross as in lanes_t), and its maxima. */
typedef struct {
    double sum, dsum, ref_sum, cross;
    LMV_LANE max, ref_max;
    int nan;       /* 1: NaN in the model's values, 2: in the reference's */
    int cross_big; /* some cross difference passed LM_CROSS_BIG */
    int64_t count; /* the rank's: values above its threshold (rank asked) */
} LM_FN(block_t);

/* A block [README: the pass]: the maxima of (z, r)[0, len) and the sums of
 * e = exp(z - shift), against shifts chosen before (finite multiples of
 * ln2f), prefetching len elements at pf and pfr (the data a few blocks
 * on). The lanes form d against the lane maxima and the sums are moved to
 * the shifts at the end. Terms are clamped to exp(LM_EXP_LO) below the shift; the caller
 * does the block again if its maxima pass the maxima before by more than
 * LM_HEAD. With rank, also the count of the model's values above thr_lo in
 * the steps before sj (a multiple of LM_STEP) and above thr from sj on:
 * one compare and one count a vector, the threshold a constant of each of
 * the loop's parts [README: rank]. */
LM_INLINE LM_FN(block_t) LM_FN(block_)(const LM_ELEM *z, const LM_ELEM *r, int64_t len,
                                        const LM_FN(ahead_t) pf, const LM_FN(ahead_t) pfr,
                                        double shift, double ref_shift, LMV_LANE lane_max,
                                        LMV_LANE ref_lane_max, const int ent, const int ref,
                                        const int rank, const lmv_t thr_lo, const lmv_t thr, int64_t sj,
                                        const LM_FN(loader_t) ld) {
    const int capped = ld.capped;
    const LM_FN(terms_t) kz = LM_FN(terms_)(shift, lane_max), kr = LM_FN(terms_)(ref_shift, ref_lane_max);
    const lmv_t zero = lmv_set1(0.0f), neginf = lmv_set1(-INFINITY);
    /* one lane sum per sum: the loop then fits AVX2's 16 registers */
    LM_FN(lanes_t) a = {zero, zero, zero, zero, neginf, neginf, neginf,
                        lmv_wide_zero(), lmv_wide_zero(), lmv_wide_zero(), lmv_wide_zero()};
    LM_FN(block_t) out;
    lmv_cnt_t cnt = lmv_cnt_zero(); /* at most 2 LM_BLK / LMV_W a lane */
#if LM_RAWMAX
    lmv_i16_t imx = lmv_imax16_init(), rimx = imx;
#endif
    /* the loop in parts cut at the prefetch's cut and at sj: no choice of
     * address or threshold in the loop */
    const int64_t cut = pf.cut <= 0 ? 0 : pf.cut >= len ? len : (pf.cut + LM_STEP - 1) / LM_STEP * LM_STEP;
    const int64_t b1 = cut < sj ? cut : sj, b2 = cut < sj ? sj : cut;
    int64_t j = 0;
    int steps = 0; /* since the last flush */
    for (int part = 0; part < 3; part++) {
        const int64_t end = part == 0 ? b1 : part == 1 ? b2 : len;
        const uintptr_t at = j < cut ? pf.in : pf.out, ref_at = j < cut ? pfr.in : pfr.out;
        const lmv_t th = j < sj ? thr_lo : thr;
        for (; j < end; j += LM_STEP) {
            lmv_t za, zb, ra = zero, rb = zero;
            LM_FN(load_)(z + j, ld, &za, &zb);
            LM_FN(prefetch_)(at, j);
            if (rank) { cnt = lmv_cnt_gt(cnt, za, th); cnt = lmv_cnt_gt(cnt, zb, th); }
            if (ref) LM_FN(prefetch_)(ref_at, j);
#if LM_RAWMAX
            if (!capped) {
                imx = lmv_imax16(imx, z + j);
                if (ref) rimx = lmv_imax16(rimx, r + j);
            }
#endif
            if (ref) LM_FN(load_)(r + j, ld, &ra, &rb);
            LM_FN(term_)(za, ra, &kz, &kr, ent, ref, !LM_RAWMAX || capped, &a);
            LM_FN(term_)(zb, rb, &kz, &kr, ent, ref, !LM_RAWMAX || capped, &a);
            if (++steps == (ref ? LM_FLUSH_REF : LM_FLUSH)) { LM_FN(flush_)(&a, ent, ref); steps = 0; }
        }
    }
    LM_FN(flush_)(&a, ent, ref);
    out.sum = lmv_wide_sum(a.wsum);
    out.ref_sum = ref ? lmv_wide_sum(a.wref_sum) : 0.0;
    /* the lanes' d used the lane maxima: move dsum and cross to the shifts */
    out.dsum = ent ? lmv_wide_sum(a.wdsum) + ((double)lane_max - shift) * out.sum : 0.0;
    out.cross = ref ? lmv_wide_sum(a.wcross) +
                      (((double)ref_lane_max - ref_shift) - ((double)lane_max - shift)) * out.ref_sum
                    : 0.0;
#if LM_RAWMAX
    if (!capped) {
        out.max = LM_FN(rawmax_)(imx, z, len);
        out.ref_max = ref ? LM_FN(rawmax_)(rimx, r, len) : (LMV_LANE)-INFINITY;
    } else
#endif
    {
        out.max = LM_FN(hmax_)(a.max);
        out.ref_max = ref ? LM_FN(hmax_)(a.ref_max) : (LMV_LANE)-INFINITY;
    }
    /* every term is finite unless z (r) holds NaN (or +inf, seen by the max) */
    out.nan = (isnan(out.sum) ? 1 : 0) | (ref && isnan(out.ref_sum) ? 2 : 0);
    out.cross_big = ref && LM_FN(hmax_)(a.cross_max) > LM_CROSS_BIG;
    out.count = rank ? lmv_cnt_sum(cnt) : 0;
    return out;
}

/* ----------------------------------------------------------------- shifts */

#ifndef LM_SHIFT_IS_MAX
/* exact / computed exp(m - shift), m a lane value [README: fix] */
LM_INLINE double LM_FN(fix_)(double m, double shift) {
    /* computed as the sums took it: a lane sum of p sc from 0 (every lane
     * holds the same term, so the lanes' sum in double is LMV_W times it) */
    lmv_t sc, p = LM_FN(expq_)(lmv_set1(m), LM_FN(expq_arg_)(shift), &sc);
    lmv_acc_t e = lmv_set1(0.0f);
    e = lmv_acc_fma(p, sc, e);
    return exp(m - shift) / (lmv_acc_sum(e) / LMV_W);
}
#endif

/* The shift for a maximum bm: K ln2f, K = ceil(bm / ln2f); NaN when out
 * of range for c1. In double lanes, bm itself (NaN beyond LM_F64_MAX). */
LM_INLINE double LM_FN(shift_of_)(double bm) {
#ifdef LM_SHIFT_IS_MAX
    return fabs(bm) <= LM_F64_MAX ? bm : NAN;
#else
    double k = ceil(bm / LM_LN2F);
    return fabs(k) <= LM_KMAX ? k * LM_LN2F : NAN;
#endif
}

/* Raise the model side's shift to cover a block max bm: its sums move
 * (lm_reshift), and so does the cross term, whose (z - shift) drops:
 * cross += (to - shift) ref_sum. Returns 0, or 1 when bm is beyond the
 * exp's range (the row takes the exact path). */
LM_INLINE int LM_FN(lift_model_)(lm_side *zs, const lm_side *rs, double *cross, const int ent,
                                  double bm) {
    double to;
    if (!(bm > zs->shift)) return 0;
    to = LM_FN(shift_of_)(bm);
    if (isnan(to)) return 1;
    if (cross && rs->sum != 0.0) *cross += (to - zs->shift) * rs->sum;
    lm_reshift(zs, ent ? &zs->dsum : NULL, to);
    return 0;
}

/* Raise the reference side's shift likewise: the cross term is a sum of
 * its e_r times (r - shift) - (z - model shift), so it moves as a wsum. */
LM_INLINE int LM_FN(lift_ref_)(lm_side *rs, double *cross, double bm) {
    double to;
    if (!(bm > rs->shift)) return 0;
    to = LM_FN(shift_of_)(bm);
    if (isnan(to)) return 1;
    lm_reshift(rs, cross, to);
    return 0;
}

/* The lane value d is formed against: the max so far, or the shift in use */
LM_INLINE LMV_LANE LM_FN(lane_max_)(const lm_side *sd) {
    return (LMV_LANE)(sd->max == -INFINITY ? lm_effective(sd->shift) : sd->max);
}

/* A first look at a side's maxima (the first block): its first shift.
 * Returns 1 when the row takes the exact path (+inf, or out of range). */
LM_INLINE int LM_FN(first_)(lm_side *sd, LMV_LANE bm) {
    if (bm > -INFINITY) {
        sd->shift = LM_FN(shift_of_)(bm);
        sd->max = bm;
        sd->block = 0;
    }
    return bm == INFINITY || isnan(sd->shift);
}

/* ------------------------------------------------------------------- rank */

/* The lane value next below t (z > below_(t) is z >= t for every lane
 * value z): float lanes step in float, double lanes in double. */
LM_INLINE LMV_LANE LM_FN(below_)(LMV_LANE t) {
    return sizeof(LMV_LANE) == sizeof(float) ? (LMV_LANE)nextafterf((float)t, -INFINITY)
                                              : (LMV_LANE)nextafter((double)t, -INFINITY);
}

/* The values of the step z[0, LM_STEP) (as the loader gives them) equal
 * to t at the elements before m: the ties that rank before the target in
 * the step that holds it, whose lanes the pass compares with t itself. */
LM_INLINE int64_t LM_FN(ties_)(const LM_ELEM *z, int64_t m, LMV_LANE t, const LM_FN(loader_t) ld) {
    LMV_LANE tmp[LM_STEP];
    lmv_t a, b;
    int64_t c = 0;
    LM_FN(load_)(z, ld, &a, &b);
    lmv_store(tmp, a);
    lmv_store(tmp + LMV_W, b);
    for (int k = 0; k < LM_STEP; k++) c += LM_LANE_ELEM(k) < m && tmp[k] == t;
    return c;
}

/* ---------------------------------------------------------------- segment */

/* A block of the segment: the whole blocks in place, then the tail copied
 * to a buffer padded with -inf to one step (with its own loader). */
typedef struct { const LM_ELEM *z, *r; int64_t len; LM_FN(loader_t) ld; } LM_FN(span_t);

LM_INLINE LM_FN(span_t) LM_FN(span_)(int64_t k, int64_t nmain, int64_t blk, int64_t nv,
                                      const LM_ELEM *z, const LM_ELEM *r, const LM_ELEM *tz,
                                      const LM_ELEM *tr, const LM_FN(loader_t) ld,
                                      const LM_FN(loader_t) ldt) {
    LM_FN(span_t) sp;
    if (k < nmain) {
        sp.z = z + k * blk;
        sp.r = r ? r + k * blk : NULL;
        sp.len = nv - k * blk < blk ? nv - k * blk : blk;
        sp.ld = ld;
    } else {
        sp.z = tz;
        sp.r = tr;
        sp.len = LM_STEP;
        sp.ld = ldt;
    }
    return sp;
}

/* add a block's sums to the sides that have a shift */
LM_INLINE void LM_FN(take_)(lm_side *zs, lm_side *rs, double *cross, const LM_FN(block_t) *b,
                             const int ref) {
    if (zs->shift != -INFINITY) { zs->sum += b->sum; zs->dsum += b->dsum; }
    if (ref && rs->shift != -INFINITY) { rs->sum += b->ref_sum; *cross += b->cross; }
}

/* Where a block prefetches: from element o of the segment p[0, n) on (o
 * past the block's start by the prefetch distance), going on at next (the
 * next segment or row) past the segment's end; with no next, the block
 * itself (from L1, a no-op). */
LM_INLINE LM_FN(ahead_t) LM_FN(ahead_)(const LM_ELEM *p, int64_t n, int64_t o, const void *next,
                                       const LM_ELEM *block) {
    const uintptr_t es = sizeof(LM_ELEM);
    LM_FN(ahead_t) a;
    a.cut = n - o;
    a.in = (uintptr_t)p + (uintptr_t)o * es;
    a.out = next ? (uintptr_t)next - (uintptr_t)a.cut * es : (uintptr_t)block;
    return a;
}

/* The segment z[0, n) (and r[0, n)) into *st [README: the pass]; next and
 * next_ref are where the data goes on after it (prefetched at its end).
 * With rank, st->rank counts the values that rank before the target's, thr
 * (a lane value), at index at of the segment (maybe outside it): those
 * above thr, and those equal to it before at [README: rank]. */
LM_INLINE void LM_FN(segment_)(const LM_ELEM *z, const LM_ELEM *r, int64_t n,
                                const int ent, const int amax, const int ref, const int rank,
                                const int capped, double cap, double thr, int64_t at,
                                const void *next, const void *next_ref, lm_state *st) {
    const int64_t blk = ref ? LM_BLK / 2 : LM_BLK; /* KL: 64 terms a lane */
    const int64_t nv = n - n % LM_STEP, nmain = (nv + blk - 1) / blk;
    const int64_t nblocks = nmain + (nv < n);
    const int64_t pfe = LM_PREFETCH_BYTES / (int64_t)sizeof(LM_ELEM);
    /* loaders of the whole blocks and of the padded tail */
    const LM_FN(loader_t) ld = LM_FN(loader_)(capped, cap, LM_STEP);
    const LM_FN(loader_t) ldt = LM_FN(loader_)(capped, cap, n - nv);
    const lm_side empty = {-INFINITY, -INFINITY, 0.0, 0.0, -1};
    lm_side zs = empty, rs = empty;
    double cross = 0.0;
    /* the rank: the steps before sstep (the step that holds the target,
     * split) count the values above thr_lo, the lane value next below thr
     * (those >= thr), the steps from sstep on the values above thr, and
     * the ties before split in split's own step are added (ties_). With
     * thr -inf nothing lies below it: the steps before sstep count every
     * value (NaN raises anyway), thr_lo = +inf none. */
    const LMV_LANE t = (LMV_LANE)thr;
    const int64_t split = !rank || at < 0 ? 0 : at > n ? n : at, sstep = split - split % LM_STEP;
    const lmv_t vthr = lmv_set1(t), vthr_lo = lmv_set1(t == -INFINITY ? (LMV_LANE)INFINITY : LM_FN(below_)(t));
    int64_t count = t == -INFINITY ? sstep : 0;
    LM_ELEM tz[LM_STEP], tr[LM_STEP];

    memset(st, 0, sizeof *st);
    if (nv < n) { /* the tail, padded with -inf to one step */
        for (int k = 0; k < LM_STEP; k++) {
            tz[k] = k < n - nv ? z[nv + k] : LM_ELEM_NEGINF;
            if (ref) tr[k] = k < n - nv ? r[nv + k] : LM_ELEM_NEGINF;
        }
    }
    for (int64_t k = 0; k < nblocks; k++) {
        const LM_FN(span_t) sp = LM_FN(span_)(k, nmain, blk, nv, z, ref ? r : NULL, tz, tr, ld, ldt);
        const int64_t o = k * blk + pfe, start = k < nmain ? k * blk : nv;
        /* the block's steps before sstep (the rank's thr_lo) */
        const int64_t sj = sstep <= start ? 0 : sstep - start < sp.len ? sstep - start : sp.len;
        /* prefetch a fixed distance ahead: in this segment, else the next */
        const LM_FN(ahead_t) pf = LM_FN(ahead_)(z, n, o, next, sp.z);
        const LM_FN(ahead_t) pfr = ref ? LM_FN(ahead_)(r, n, o, next_ref, sp.r) : pf;
        LM_FN(block_t) b;
        int redo;
        if (k == 0) { /* a first look at the maxima: the first shifts */
            int exact = LM_FN(first_)(&zs, LM_FN(max_)(sp.z, sp.len, sp.ld));
            if (ref) exact |= LM_FN(first_)(&rs, LM_FN(max_)(sp.r, sp.len, sp.ld));
            if (exact) { st->exact = 1; return; }
        }
        b = LM_FN(block_)(sp.z, sp.r, sp.len, pf, pfr, lm_effective(zs.shift), lm_effective(rs.shift),
                          LM_FN(lane_max_)(&zs), LM_FN(lane_max_)(&rs), ent, ref, rank, vthr_lo, vthr, sj,
                          sp.ld);
        count += b.count; /* (a redo counts the same values again: not taken) */
        if (b.max == INFINITY || b.ref_max == INFINITY || b.cross_big) { st->exact = 1; return; }
        /* [README: the redo rule] */
        redo = b.max > zs.max + LM_HEAD || (ref && b.ref_max > rs.max + LM_HEAD);
        if (!redo) LM_FN(take_)(&zs, &rs, &cross, &b, ref);
        if (b.max > zs.max) { zs.max = b.max; zs.block = k; }
        if (ref && b.ref_max > rs.max) { rs.max = b.ref_max; rs.block = k; }
        if (LM_FN(lift_model_)(&zs, &rs, ref ? &cross : NULL, ent, b.max) ||
            (ref && LM_FN(lift_ref_)(&rs, &cross, b.ref_max))) {
            st->exact = 1;
            return;
        }
        if (redo) { /* again, from L1, against the new shifts and maxima */
            const LM_FN(ahead_t) here = {(uintptr_t)sp.z, (uintptr_t)sp.z, sp.len},
                                 ref_here = {(uintptr_t)sp.r, (uintptr_t)sp.r, sp.len};
            b = LM_FN(block_)(sp.z, sp.r, sp.len, here, ref_here, lm_effective(zs.shift),
                              lm_effective(rs.shift), LM_FN(lane_max_)(&zs), LM_FN(lane_max_)(&rs),
                              ent, ref, rank, vthr_lo, vthr, sj, sp.ld);
            if (b.cross_big) { st->exact = 1; return; }
            LM_FN(take_)(&zs, &rs, &cross, &b, ref);
        }
        st->nan |= b.nan;
    }
    /* The maxima rise only at blocks whose max exceeds all before: the
     * first argmax lies in the block of the last rise. */
    if (amax) {
        if (zs.block >= 0) {
            const LM_FN(span_t) sp = LM_FN(span_)(zs.block, nmain, blk, nv, z, NULL, tz, tr, ld, ldt);
            st->argmax = (zs.block < nmain ? zs.block * blk : nv) +
                         LM_FN(find_)(sp.z, sp.len, (LMV_LANE)zs.max, sp.ld);
        } else {
            st->argmax = -1;
        }
        if (ref && rs.block >= 0) {
            const LM_FN(span_t) sp = LM_FN(span_)(rs.block, nmain, blk, nv, r, NULL, tr, tr, ld, ldt);
            st->ref_argmax = (rs.block < nmain ? rs.block * blk : nv) +
                             LM_FN(find_)(sp.z, sp.len, (LMV_LANE)rs.max, sp.ld);
        } else {
            st->ref_argmax = -1;
        }
    } else {
        st->argmax = st->ref_argmax = -1;
    }
#ifndef LM_SHIFT_IS_MAX
    /* The max's own term exact [README: fix]: every term carries the exp's
     * error (the same for a value against any shift); scaling a side's sums
     * by exact / computed of its max makes that term exact and keeps
     * log-probabilities <= 0 and a one-hot row's entropy 0. */
    if (zs.max > -INFINITY) {
        double a = LM_FN(fix_)(zs.max, zs.shift);
        zs.sum *= a;
        zs.dsum *= a;
    }
    if (ref && rs.max > -INFINITY) {
        double a = LM_FN(fix_)(rs.max, rs.shift);
        rs.sum *= a;
        cross *= a;
    }
#endif
    st->shift = zs.shift; st->sum = zs.sum; st->dsum = zs.dsum; st->max = zs.max;
    st->ref_shift = rs.shift; st->ref_sum = rs.sum; st->cross = cross; st->ref_max = rs.max;
    if (rank && split > sstep) /* split's step, its lanes compared with thr: its ties before split */
        count += LM_FN(ties_)(sstep < nv ? z + sstep : tz, split - sstep, t, sstep < nv ? ld : ldt);
    st->rank = count;
}

/* The exported kernel: specialised for the flag sets the driver uses, each
 * specialisation a function of its own (LM_SPEC: the flags constants, the
 * body folded to what they ask). Not one function holding them all, inlined
 * side by side: GCC 12 then allocated the registers of the whole (a dozen
 * copies of the pass and their loops) worse, and the evaluate pass without
 * rank ran 4.6% more instructions (AVX2: a register copy a vector in the
 * loop, spills per block) once the rank's four copies had joined
 * [README: rank]. */
#define LM_SPEC_FN(f) LM_FN(LM_NAME3(spec, f, flags)) /* spec_3_flags_avx2_f32 */
#define LM_SPEC(f)                                                             \
    LM_NOINLINE void LM_SPEC_FN(f)(const LM_ELEM *z, const LM_ELEM *r, int64_t n, double cap, \
                                   double thr, int64_t at, const void *next,                    \
                                   const void *next_ref, lm_state *st) {                        \
        LM_FN(segment_)(z, r, n, (f) & LM_WANT_ENT, (f) & LM_WANT_AMAX, (f) & LM_WANT_REF, \
                        (f) & LM_WANT_RANK, (f) & LM_WANT_CAP, cap, thr, at, next, next_ref, st); \
    }
/* the flag sets, as numbers (names are made of them): 0, CAP (8), ENT |
 * AMAX (3), with CAP (11); the same with RANK (16, 24, 19, 27) and with
 * REF (4, 12, 7, 15) */
#define LM_SPECS(X) X(0) X(8) X(3) X(11) X(16) X(24) X(19) X(27) X(4) X(12) X(7) X(15)
typedef char LM_FN(specs_flags_check)[LM_WANT_ENT == 1 && LM_WANT_AMAX == 2 && LM_WANT_REF == 4 &&
                                      LM_WANT_CAP == 8 && LM_WANT_RANK == 16 ? 1 : -1];
LM_SPECS(LM_SPEC)
/* any other flag set: the flags as values */
LM_NOINLINE void LM_FN(spec_any)(const LM_ELEM *z, const LM_ELEM *r, int64_t n, int flags,
                                 double cap, double thr, int64_t at, const void *next,
                                 const void *next_ref, lm_state *st) {
    LM_FN(segment_)(z, r, n, flags & LM_WANT_ENT, flags & LM_WANT_AMAX, flags & LM_WANT_REF,
                    flags & LM_WANT_RANK, flags & LM_WANT_CAP, cap, thr, at, next, next_ref, st);
}
static void LM_FN(segment)(const void *z, const void *r, int64_t n, int flags,
                           double cap, double thr, int64_t at, const void *next,
                           const void *next_ref, lm_state *st) {
    const LM_ELEM *zz = (const LM_ELEM *)z, *rr = (const LM_ELEM *)r;
#define LM_CASE(f)                                                             \
    case f: LM_SPEC_FN(f)(zz, rr, n, cap, thr, at, next, next_ref, st); return;
    switch (flags) {
        LM_SPECS(LM_CASE)
    default: LM_FN(spec_any)(zz, rr, n, flags, cap, thr, at, next, next_ref, st);
    }
#undef LM_CASE
}
#undef LM_SPEC
#undef LM_SPECS
#undef LM_SPEC_FN

/* Element k of z as the lanes see it (lm_value_fn): loaded as the pass
 * loads it, capped by the same lane code (cap > 0), so that the rank's
 * threshold and the values it is compared with are the same function of
 * the stored element [README: rank]. */
static double LM_FN(value)(const void *z, int64_t k, double cap) {
    LM_ELEM buf[LM_STEP];
    LMV_LANE tmp[LMV_W];
    lmv_t a, b;
    for (int i = 0; i < LM_STEP; i++) buf[i] = ((const LM_ELEM *)z)[k];
    LM_FN(load_)(buf, LM_FN(loader_)(cap > 0, cap > 0 ? cap : 1.0, LM_STEP), &a, &b);
    lmv_store(tmp, a);
    return (double)tmp[0];
}

/* what this file defined for one instantiation */
#undef LM_EXP_LO
#undef LM_Q
#undef LM_RAWMAX
#undef LM_STEP
#undef LM_BLK
#undef LM_HEAD
#undef LM_KMAX
#undef LM_F64_MAX
#undef LM_SHIFT_IS_MAX
#undef LM_CROSS_BIG
#undef LM_FLUSH
#undef LM_FLUSH_REF
