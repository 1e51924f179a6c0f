/* The one kernel body: a segment of a row (or of a row pair, for KL) in one
 * pass over memory. Included once per (ISA, dtype) by lm_instantiate.h after
 * an lm_simd_*.h header has defined the vector primitives:
 *   VF, VW, LANE_T, v_set1, v_add, v_sub, v_mul, v_div, v_fma (fused), v_max,
 *   v_abs, v_copysign, v_scale, v_pow2q, v_sel_n0, v_zero_neginf, v_any_eq,
 *   v_store,
 * and the dtype macros:
 *   LM_ELEM (storage type), LM_ELEM_NEGINF,
 *   LM_LOAD2(p, a, b)  load 2*VW elements into two vectors (any lane order),
 *   LM_LANE_ELEM(k)    element offset of position k in [a lanes, b lanes],
 *   LM_FN(name)        the name of this instantiation's function.
 *
 * The pass walks the segment in blocks and reads each element once: one
 * loop takes a block's max and its sum of exp(z - shift), the shift a
 * multiple of ln 2 at or above the max of the blocks before (the first
 * block's max is taken alone first). A block whose max passes the max
 * before it by more than LM_HEAD is done again, from L1, against its own;
 * with real and random logits that is a block or two a row. The exp
 * folds the shift into its range reduction (expq_), so a term costs a
 * clamp, two fused multiply-adds and a subtraction, a polynomial (a cubic
 * with AVX2's 4-entry table, a quadratic with the 32-entry table of
 * AVX-512 and the portable path), a table lookup and the fused add into
 * the sum. 16-bit blocks take their max on the raw bits where the ISA has
 * a 16-bit integer max that pays (AVX-512BW). Float lane accumulators are
 * flushed to double once per block.
 */

#define LM_STEP (2 * VW)
/* block length: at most 4096 elements and 128 terms per float lane
 * accumulator, 64 in the KL pass (longer float sums cost accuracy) */
#define LM_BLK (64 * LM_STEP < LM_BLOCK ? 64 * LM_STEP : LM_BLOCK)

#ifndef LM_BODY_ONCE
#define LM_BODY_ONCE
#define LM_CAT_(a, b) a##b
#define LM_CAT(a, b) LM_CAT_(a, b)
#define LM_INLINE LM_ALWAYS_INLINE /* lm_port.h */
#endif

#define LM_LN2F 0.693147182464599609375 /* ln 2 rounded to float, exactly */

#ifdef LM_LIBM_EXP
#define LM_EXP_LO (-746.0)
LM_INLINE VF LM_FN(cap_)(VF x, VF c, VF ic) { (void)ic; return c * tanh(x / c); }
/* e^(z - shift) = p * sc for z in [shift + LM_EXP_LO, shift + LM_HEAD] */
LM_INLINE VF LM_FN(expq_)(VF z, VF c1, VF sh, VF *sc) { (void)c1; *sc = 1.0; return exp(z - sh); }
#else
#define LM_EXP_LO (-86.0f)
#define LM_MAGIC 12582912.0f /* 1.5 * 2^23: t = x / ln2 + MAGIC holds round(x / ln2) in its low bits */
/* e^r = 1 + r + r^2 * D(r), D = c2 + c3 r + c4 r^2 + c5 r^3 (degree-5
 * polynomial, max 2.4 ulp for exp), by Estrin's scheme. Used by the
 * softcap's expm1, which needs the whole range [-ln2/2, ln2/2] for r. */
#define LM_EXP_D(r, r2)                                                        \
    v_fma(v_fma(v_set1(0.008312525227665901f), r, v_set1(0.041890114545822144f)), r2, \
          v_fma(v_set1(0.16667114198207855f), r, v_set1(0.499992311000824f)))
/* Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, for x in
 * [LM_EXP_LO, 0]: sets t (n in its low bits), r and r^2, returns D(r), so
 * that e^r = 1 + r + r^2 D(r). */
LM_INLINE VF LM_FN(reduce_)(VF x, VF *t, VF *r, VF *r2) {
    *t = v_fma(x, v_set1(1.44269504088896341f), v_set1(LM_MAGIC));
    *r = v_fma(v_sub(*t, v_set1(LM_MAGIC)), v_set1(-0.69314718055994531f), x);
    *r2 = v_mul(*r, *r);
    return LM_EXP_D(*r, *r2);
}
/* softcap: c * tanh(x / c) = sign(x) * c * (-em1 / (2 + em1)),
 * em1 = expm1(-2|x|/c), accurate near 0 (for n == 0 em1 is q itself). */
LM_INLINE VF LM_FN(cap_)(VF x, VF c, VF ic) {
    VF y = v_max(v_set1(LM_EXP_LO), v_mul(v_abs(v_mul(x, ic)), v_set1(-2.0f)));
    VF t, r, r2, d = LM_FN(reduce_)(y, &t, &r, &r2);
    VF q = v_fma(d, r2, r);                         /* e^r - 1 */
    VF em1 = v_sel_n0(v_sub(t, v_set1(LM_MAGIC)), q,
                      v_sub(v_scale(v_add(q, v_set1(1.0f)), t), v_set1(1.0f)));
    VF tnh = v_div(v_sub(v_set1(0.0f), em1), v_add(em1, v_set1(2.0f)));
    return v_copysign(v_mul(tnh, c), x);
}
/* The sums' exp: e^(z - K ln2f) = p * sc, ln2f = ln 2 rounded to float,
 * for z in [shift + LM_EXP_LO, shift + LM_HEAD], shift = K ln2f, with no
 * subtraction of the shift. With Q = 2^LM_QBITS table entries (the ISA's
 * choice) and c1 = MAGIC - QK, t = Q z / ln2 + c1 holds N - QK in its low
 * bits, N = round(Q z / ln2); then z - K ln2f = r + (N - QK) ln2f / Q with
 * r = z - N ln2f / Q (one fused rounding, |r| <= ln2 / 2Q): e^r by a
 * polynomial, and sc = 2^((N - QK) / Q) from the table and the exponent
 * field (v_pow2q). Q = 4: a cubic (3e-7 relative); Q = 32: a quadratic
 * (5e-8). ln2f's error, (N - QK) * 1.9e-9 / Q relative, is nil near the
 * maximum, where the terms that count are. NaN in z gives a NaN p. */
#define LM_Q (1 << LM_QBITS)
LM_INLINE VF LM_FN(expq_)(VF z, VF c1, VF sh, VF *sc) {
    VF t = v_fma(z, v_set1(LM_Q * 1.44269504088896341f), c1); /* Q / ln 2 */
    VF r = v_fma(v_sub(t, c1), v_set1(-LM_LN2F / LM_Q), z);    /* ln2f / Q, exact */
    (void)sh;
    *sc = v_pow2q(t);
#if LM_QBITS >= 5
    return v_fma(v_fma(v_set1(0.4999963045120239f), r, v_set1(1.0000146627426147f)), r,
                 v_set1(1.0f));
#else
    return v_fma(v_fma(v_fma(v_set1(0.16660411655902863f), r, v_set1(0.5003126263618469f)), r,
                       v_set1(1.0000005960464478f)),
                 r, v_set1(0.9999997019767761f));
#endif
}
#endif
/* A block whose max passes the max before it (or the shift) by more than
 * this is done again against the new max and shift: terms then stay
 * below max + 1, within the exp's range, and the sums of e (z - max)
 * (entropy, KL) keep float accuracy, the terms that count having
 * z - max small. Every mode redoes the same blocks (same sums). */
#define LM_HEAD 1.0
/* |K| bound for c1 = MAGIC - QK to stay exact: rows whose maxima pass
 * +-2^21 ln2 / Q (3.6e5 for Q = 4, 4.5e4 for Q = 32) take the exact path. */
#define LM_KMAX (2097152.0 / LM_Q)

#define LM_LOADC(p, a, b)                                                      \
    do {                                                                       \
        LM_LOAD2(p, a, b);                                                     \
        if (capped) { a = LM_FN(cap_)(a, vc, vic); b = LM_FN(cap_)(b, vc, vic); } \
    } while (0)

LM_INLINE LANE_T LM_FN(hmax_)(VF v) {
    LANE_T tmp[VW], m;
    v_store(tmp, v);
    m = tmp[0];
    for (int k = 1; k < VW; k++) m = tmp[k] > m ? tmp[k] : m;
    return m;
}

LM_INLINE double LM_FN(hsum_)(VF v) {
    LANE_T tmp[VW];
    double s = 0.0;
    v_store(tmp, v);
    for (int k = 0; k < VW; k++) s += (double)tmp[k];
    return s;
}

/* max over len elements (len a multiple of LM_STEP); NaN is skipped here and
 * caught by the exp pass. */
LM_INLINE LANE_T LM_FN(max_)(const LM_ELEM *z, int64_t len, int capped, VF vc, VF vic) {
    VF m0 = v_set1(-INFINITY), m1 = m0;
    for (int64_t j = 0; j < len; j += LM_STEP) {
        VF a, b;
        LM_LOADC(z + j, a, b);
        m0 = v_max(a, m0);
        m1 = v_max(b, m1);
    }
    return LM_FN(hmax_)(v_max(m0, m1));
}

/* first index in [0, len) whose (capped) value equals bm: a vector test
 * per step, a lane scan only in the step that holds it */
LM_INLINE int64_t LM_FN(find_)(const LM_ELEM *z, int64_t len, LANE_T bm, int capped, VF vc, VF vic) {
    const VF vbm = v_set1(bm);
    for (int64_t j = 0; j < len; j += LM_STEP) {
        VF a, b;
        LANE_T tmp[LM_STEP];
        int64_t best = -1;
        LM_LOADC(z + j, a, b);
        if (!(v_any_eq(a, vbm) || v_any_eq(b, vbm))) continue;
        v_store(tmp, a);
        v_store(tmp + VW, b);
        for (int k = 0; k < LM_STEP; k++)
            if (tmp[k] == bm && (best < 0 || LM_LANE_ELEM(k) < best)) best = LM_LANE_ELEM(k);
        if (best >= 0) return j + best;
    }
    return 0;
}

#if LM_RAW16 && defined(v_imax16)
#define LM_RAWMAX 1
/* A 16-bit block's max from the signed 16-bit max of its raw bits (one
 * integer max a vector instead of a float max per half): exact when that
 * is a number >= +0, sign-magnitude ordering like the integers there. A
 * block of negative numbers only, or holding a positive NaN, takes the
 * float max again, from L1. */
LM_INLINE LANE_T LM_FN(rawmax_)(VI16 acc, const LM_ELEM *z, int64_t len) {
    int16_t tmp[sizeof(VI16) / 2];
    int m = -32768;
    v_imax16_store(tmp, acc);
    for (int k = 0; k < (int)(sizeof(VI16) / 2); k++) m = tmp[k] > m ? tmp[k] : m;
    if (m >= 0 && m <= LM_ELEM_POSINF) return LM_ELEM_TO_FLOAT((uint16_t)m);
    return LM_FN(max_)(z, len, 0, v_set1(1.0f), v_set1(1.0f));
}
#else
#define LM_RAWMAX 0
#endif

/* What one block gives, in double: sums against the shifts (MS, RMS) it
 * was given, and its maxima. */
typedef struct { double s, t, rs, c; LANE_T zmax, rmax; int nan; } LM_FN(acc_);

/* One block in one pass: the maxima of (z, r)[0, len) and sum e (z - MS),
 * e = exp(z - MS), against shifts (MS, RMS) chosen before (finite, each
 * a multiple of ln2f), prefetching pf[0, len) (the data a few blocks on).
 * The lanes form d = z - ms against lane values (ms, rms), the maxima so
 * far (a one-hot row's d is then 0), and move the sums to the shifts.
 * Terms are clamped to exp(LM_EXP_LO) below the shift; the caller does
 * the block again if its maxima pass the maxima before by more than LM_HEAD. */
LM_INLINE void LM_FN(block_)(const LM_ELEM *z, const LM_ELEM *r, int64_t len,
                              const char *pf, double MS, double RMS, LANE_T ms, LANE_T rms,
                              const int ent, const int ref, const int capped,
                              VF vc, VF vic, LM_FN(acc_) *out) {
    const VF zero = v_set1(0.0f);
    const VF lo = v_set1((LANE_T)(MS + LM_EXP_LO)), rlo = v_set1((LANE_T)(RMS + LM_EXP_LO));
    const VF vms = v_set1(ms), vrms = v_set1(rms), vsh = v_set1(MS), vrsh = v_set1(RMS);
#ifdef LM_LIBM_EXP
    const VF k1 = zero, rk1 = zero;
#else /* see expq_ */
    const VF k1 = v_set1(LM_MAGIC - (float)(LM_Q * MS / LM_LN2F));
    const VF rk1 = v_set1(LM_MAGIC - (float)(LM_Q * RMS / LM_LN2F));
#endif
    /* one accumulator per sum: the loop then fits AVX2's 16 registers */
    VF s = zero, t = zero, rs = zero, c = zero;
    VF mx = v_set1(-INFINITY), rmx = mx;
#if LM_RAWMAX
    VI16 imx = v_imax16_init(), rimx = imx;
#endif

/* One vector x (and the reference's y) into the sums: max, clamp (a NaN
 * survives it), e = p sc, s += p sc fused (the same in every mode). Each
 * vector is done before the next, to keep few values live. */
#define LM_HALF(x, y)                                                          \
    do {                                                                       \
        VF xc_ = v_max(lo, x), sc_, p_;                                        \
        if (!LM_RAWMAX || capped) mx = v_max(x, mx);                           \
        p_ = LM_FN(expq_)(xc_, k1, vsh, &sc_);                                 \
        s = v_fma(p_, sc_, s);                                                 \
        if (ent) t = v_fma(v_mul(p_, sc_), v_sub(xc_, vms), t);                \
        if (ref) {                                                             \
            VF yc_ = v_max(rlo, y), e_;                                        \
            if (!LM_RAWMAX || capped) rmx = v_max(y, rmx);                     \
            p_ = LM_FN(expq_)(yc_, rk1, vrsh, &sc_);                           \
            rs = v_fma(p_, sc_, rs);                                           \
            e_ = v_mul(p_, sc_);                                               \
            /* e_r ((r - rms) - (z - ms)), z unclamped: -inf there gives +inf */ \
            c = v_fma(e_, v_zero_neginf(v_sub(v_sub(yc_, vrms), v_sub(x, vms)), y), c); \
        }                                                                      \
    } while (0)

    for (int64_t j = 0; j < len; j += LM_STEP) {
        VF za, zb, ra = zero, rb = zero;
        LM_LOADC(z + j, za, zb);
        LM_PREFETCH(pf + j * (int64_t)sizeof(LM_ELEM));
#if LM_RAWMAX
        if (!capped) {
            imx = v_imax16(imx, z + j);
            if (ref) rimx = v_imax16(rimx, r + j);
        }
#endif
        if (ref) LM_LOADC(r + j, ra, rb);
        LM_HALF(za, ra);
        LM_HALF(zb, rb);
    }
#undef LM_HALF
    out->s = LM_FN(hsum_)(s);
    out->rs = ref ? LM_FN(hsum_)(rs) : 0.0;
    /* the lanes' d used ms, rms: move t and c to the shifts */
    out->t = ent ? LM_FN(hsum_)(t) + ((double)ms - MS) * out->s : 0.0;
    out->c = ref ? LM_FN(hsum_)(c) + (((double)rms - RMS) - ((double)ms - MS)) * out->rs : 0.0;
#if LM_RAWMAX
    if (!capped) {
        out->zmax = LM_FN(rawmax_)(imx, z, len);
        out->rmax = ref ? LM_FN(rawmax_)(rimx, r, len) : (LANE_T)-INFINITY;
    } else
#endif
    {
        out->zmax = LM_FN(hmax_)(mx);
        out->rmax = ref ? LM_FN(hmax_)(rmx) : (LANE_T)-INFINITY;
    }
    /* every term is finite unless z (r) holds NaN (or +inf, seen by the max) */
    out->nan = (isnan(out->s) ? 1 : 0) | (ref && isnan(out->rs) ? 2 : 0);
}

#ifndef LM_LIBM_EXP
/* exact / computed exp(m - ms), m a lane value, ms a shift */
LM_INLINE double LM_FN(fix_)(double m, double ms) {
    LANE_T e[VW];
    VF sc, p = LM_FN(expq_)(v_set1(m), v_set1(LM_MAGIC - (float)(LM_Q * ms / LM_LN2F)), v_set1(ms), &sc);
    v_store(e, v_mul(p, sc));
    return exp(m - ms) / (double)e[0];
}
#endif

/* The shift for a maximum bm: K ln2f, K = ceil(bm / ln2f); NaN when out
 * of range for c1. With libm's exp, bm itself. */
LM_INLINE double LM_FN(shift_of_)(double bm) {
#ifdef LM_LIBM_EXP
    return bm;
#else
    double k = ceil(bm / LM_LN2F);
    return fabs(k) <= LM_KMAX ? k * LM_LN2F : NAN;
#endif
}

/* Raise the shift of one side from *m to bm: s scales by a = exp(m - bm),
 * and t = sum e (z - m) (t: the same side's weights and shift) becomes
 * a (t + (m - bm) s). The cross term c = sum e_r ((r - rm) - (z - m)) moves
 * with both sides: pass the reference side's (RS, &C) when raising the
 * model side (c += (bm - m) RS, as z - m drops), and its own (&C) as t
 * when raising the reference side. */
LM_INLINE void LM_FN(raise_)(double *m, double *s, double *t, double rs, double *c, double bm) {
    if (c && rs != 0.0) *c += (bm - *m) * rs;
    if (*s != 0.0) {
        double a = exp(*m - bm);
        if (t) *t = a * (*t + (*m - bm) * *s);
        *s *= a;
    }
    *m = bm;
}

LM_INLINE void LM_FN(segment_)(const LM_ELEM *z, const LM_ELEM *r, int64_t n,
                                const int ent, const int amax, const int ref,
                                const int capped, float cap, const void *next,
                                lm_state *st) {
    const VF vc = v_set1(capped ? cap : 1.0f), vic = v_set1(capped ? 1.0f / cap : 1.0f);
    const int64_t blk = ref ? LM_BLK / 2 : LM_BLK; /* KL: 64 terms a lane */
    const int64_t nv = n - n % LM_STEP, nmain = (nv + blk - 1) / blk;
    const int64_t nblocks = nmain + (nv < n);
    const int64_t pfe = LM_PREFETCH_BYTES / (int64_t)sizeof(LM_ELEM);
    LM_ELEM tz[LM_STEP], tr[LM_STEP];
    /* maxima so far; shifts (the sums are of exp(z - MS)), -inf until a
     * finite value is seen */
    double M = -INFINITY, RM = -INFINITY, MS = -INFINITY, RMS = -INFINITY;
    double S = 0.0, T = 0.0, RS = 0.0, C = 0.0;
    int64_t am = -1, ram = -1, kz = -1, kr = -1; /* blocks of the final maxima */

    memset(st, 0, sizeof *st);
    if (nv < n) { /* the tail, padded with -inf to one step */
        for (int k = 0; k < LM_STEP; k++) {
            tz[k] = k < n - nv ? z[nv + k] : LM_ELEM_NEGINF;
            if (ref) tr[k] = k < n - nv ? r[nv + k] : LM_ELEM_NEGINF;
        }
    }
#define LM_BLK_LEN(k) (nv - (k) * blk < blk ? nv - (k) * blk : blk)
#define LM_BLOCK_AT(k, zp, rp, len)                                            \
    do {                                                                       \
        if ((k) < nmain) {                                                     \
            zp = z + (k) * blk; rp = ref ? r + (k) * blk : NULL;               \
            len = LM_BLK_LEN(k);                                               \
        } else { zp = tz; rp = tr; len = LM_STEP; }                            \
    } while (0)
/* a side's shift rises when its block max passes it; the block is done
 * again when the max passes the max before it by more than LM_HEAD (a
 * side with no max yet: any finite max) */
#define LM_REDO(bm, mx) ((bm) > (mx) + LM_HEAD)
/* the shift a block is computed against: 0 while a side has none (its
 * sums are then dropped; the pass still looks for NaN) */
#define LM_EFF(sh) ((sh) == -INFINITY ? 0.0 : (sh))
/* the lane value d = z - ref is formed against: the max so far */
#define LM_REF(mx, sh) ((LANE_T)((mx) == -INFINITY ? LM_EFF(sh) : (mx)))
/* raise a side's shift sh to cover its block max bm (raise_'s other
 * arguments follow); beyond the exp's range the row takes the exact path */
#define LM_LIFT(bm, sh, ...)                                                   \
    do {                                                                       \
        if ((bm) > (sh)) {                                                     \
            double to_ = LM_FN(shift_of_)(bm);                                 \
            if (isnan(to_)) { st->slow = 1; return; }                          \
            LM_FN(raise_)(&(sh), __VA_ARGS__, to_);                            \
        }                                                                      \
    } while (0)
#define LM_TAKE()                                                              \
    do {                                                                       \
        if (MS != -INFINITY) { S += acc.s; T += acc.t; }                       \
        if (ref && RMS != -INFINITY) { RS += acc.rs; C += acc.c; }             \
    } while (0)

    for (int64_t k = 0; k < nblocks; k++) {
        const LM_ELEM *zp, *rp;
        const char *pf;
        int64_t len, o = k * blk + pfe;
        double bm, brm;
        int redo;
        LM_FN(acc_) acc;
        LM_BLOCK_AT(k, zp, rp, len);
        /* prefetch a fixed distance ahead: in this segment, else the next */
        pf = o < n ? (const char *)(z + o)
           : next ? (const char *)next + (o - n) * (int64_t)sizeof(LM_ELEM) : (const char *)zp;
        if (k == 0) { /* a first look at the maxima: the first shifts */
            bm = LM_FN(max_)(zp, len, capped, vc, vic);
            brm = ref ? LM_FN(max_)(rp, len, capped, vc, vic) : (LANE_T)-INFINITY;
            if (bm > -INFINITY) { MS = LM_FN(shift_of_)(bm); M = bm; kz = 0; }
            if (brm > -INFINITY) { RMS = LM_FN(shift_of_)(brm); RM = brm; kr = 0; }
            if (bm == INFINITY || brm == INFINITY || isnan(MS) || isnan(RMS)) { st->slow = 1; return; }
        }
        LM_FN(block_)(zp, rp, len, pf, LM_EFF(MS), LM_EFF(RMS), LM_REF(M, MS), LM_REF(RM, RMS),
                      ent, ref, capped, vc, vic, &acc);
        bm = acc.zmax;
        brm = acc.rmax;
        if (bm == INFINITY || brm == INFINITY) { st->slow = 1; return; }
        redo = LM_REDO(bm, M) || (ref && LM_REDO(brm, RM));
        if (!redo) LM_TAKE();
        if (bm > M) { M = bm; kz = k; }
        if (ref && brm > RM) { RM = brm; kr = k; }
        LM_LIFT(bm, MS, &S, ent ? &T : NULL, RS, ref ? &C : NULL);
        if (ref) LM_LIFT(brm, RMS, &RS, &C, 0.0, NULL);
        if (redo) { /* again, from L1, against the new shifts and maxima */
            LM_FN(block_)(zp, rp, len, (const char *)zp, LM_EFF(MS), LM_EFF(RMS),
                          LM_REF(M, MS), LM_REF(RM, RMS), ent, ref, capped, vc, vic, &acc);
            LM_TAKE();
        }
        st->nan_found |= acc.nan;
    }
    /* The maxima rise only at blocks whose max exceeds all before: the
     * first argmax lies in the block of the last rise. */
#define LM_FIND_IN(k, base, tail, mx)                                          \
    ((k) < nmain ? (k) * blk + LM_FN(find_)((base) + (k) * blk, LM_BLK_LEN(k),  \
                                            (LANE_T)(mx), capped, vc, vic)     \
                 : nv + LM_FN(find_)(tail, LM_STEP, (LANE_T)(mx), capped, vc, vic))
    if (amax && kz >= 0) am = LM_FIND_IN(kz, z, tz, M);
    if (amax && ref && kr >= 0) ram = LM_FIND_IN(kr, r, tr, RM);
#undef LM_FIND_IN
#undef LM_REDO
#undef LM_EFF
#undef LM_REF
#undef LM_TAKE
#undef LM_LIFT
#undef LM_BLOCK_AT
#undef LM_BLK_LEN
#ifndef LM_LIBM_EXP
    /* The max's own term exact: every term carries the exp's error (up to
     * 3e-7, the same for a value against any shift); scaling a side's sums
     * by exact / computed of its max makes that term exact and keeps
     * log-probabilities <= 0 and a one-hot row's entropy 0. */
    if (M > -INFINITY) {
        double a = LM_FN(fix_)(M, MS);
        S *= a;
        T *= a;
    }
    if (ref && RM > -INFINITY) {
        double a = LM_FN(fix_)(RM, RMS);
        RS *= a;
        C *= a;
    }
#endif
    st->m = MS; st->s = S; st->t = T; st->mx = M; st->amax = am;
    st->rm = RMS; st->rs = RS; st->c = C; st->rmx = RM; st->ramax = ram;
}

/* The exported kernel: specialised for the flag sets the driver uses. */
static void LM_FN(segment)(const void *z, const void *r, int64_t n, int flags,
                           float cap, const void *next, lm_state *st) {
    const LM_ELEM *zz = (const LM_ELEM *)z, *rr = (const LM_ELEM *)r;
#define LM_CASE(f)                                                             \
    case f:                                                                    \
        LM_FN(segment_)(zz, rr, n, (f) & LM_WANT_ENT, (f) & LM_WANT_AMAX,      \
                        (f) & LM_WANT_REF, (f) & LM_WANT_CAP, cap, next, st);  \
        return;
    switch (flags) {
        LM_CASE(0)
        LM_CASE(LM_WANT_CAP)
        LM_CASE(LM_WANT_ENT | LM_WANT_AMAX)
        LM_CASE(LM_WANT_ENT | LM_WANT_AMAX | LM_WANT_CAP)
        LM_CASE(LM_WANT_ENT | LM_WANT_AMAX | LM_WANT_REF)
        LM_CASE(LM_WANT_ENT | LM_WANT_AMAX | LM_WANT_REF | LM_WANT_CAP)
    default:
        LM_FN(segment_)(zz, rr, n, flags & LM_WANT_ENT, flags & LM_WANT_AMAX,
                        flags & LM_WANT_REF, flags & LM_WANT_CAP, cap, next, st);
    }
#undef LM_CASE
}

#undef LM_LOADC
#undef LM_EXP_LO
#undef LM_MAGIC
#undef LM_Q
#undef LM_RAWMAX
#undef LM_STEP
#undef LM_BLK
