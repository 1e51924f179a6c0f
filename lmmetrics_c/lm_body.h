/* The one kernel body: a segment of a row (or of a row pair, for KL) in one
 * pass over memory. Included once per (ISA, dtype) by lm_instantiate.h after
 * an lm_simd_*.h header has defined the vector primitives:
 *   VF, VW, LANE_T, v_set1, v_add, v_sub, v_mul, v_div, v_fma, v_max, v_abs,
 *   v_copysign, v_scale, v_sel_n0, v_zero_neginf, v_any_eq, v_store,
 * and the dtype macros:
 *   LM_ELEM (storage type), LM_ELEM_NEGINF, LM_DT (enum lm_dtype),
 *   LM_LOAD2(p, a, b)  load 2*VW elements into two vectors (any lane order),
 *   LM_LANE_ELEM(k)    element offset of position k in [a lanes, b lanes],
 *   LM_FN(name)        the name of this instantiation's function.
 *
 * The pass walks the segment in blocks of LM_BLOCK elements. In one loop it
 * takes the max of block k+1 (streaming from memory, prefetching ahead) and
 * sum exp(z - m) of block k (in L1 since the previous loop), so memory and
 * arithmetic overlap. The running max only changes at block boundaries;
 * float lane accumulators are flushed to double once per block.
 */

#define LM_STEP (2 * VW)
/* block length: at most 4096 elements and 64 terms per float lane
 * accumulator (longer float sums cost KL and entropy accuracy) */
#define LM_BLK (64 * LM_STEP < LM_BLOCK ? 64 * LM_STEP : LM_BLOCK)

#ifndef LM_BODY_ONCE
#define LM_BODY_ONCE
#define LM_CAT_(a, b) a##b
#define LM_CAT(a, b) LM_CAT_(a, b)
#define LM_INLINE static inline __attribute__((always_inline))
#endif

#ifdef LM_LIBM_EXP
#define LM_EXP_LO (-746.0)
LM_INLINE VF LM_FN(exp_)(VF x) { return exp(x); }
LM_INLINE VF LM_FN(cap_)(VF x, VF c, VF ic) { (void)ic; return c * tanh(x / c); }
#else
#define LM_EXP_LO (-86.0f)
#define LM_MAGIC 12582912.0f /* 1.5 * 2^23: t = x / ln2 + MAGIC holds round(x / ln2) in its low bits */
/* e^r = 1 + r + r^2 * D(r), D = c2 + c3 r + c4 r^2 + c5 r^3 (degree-5
 * polynomial, max 2.4 ulp for exp), by Estrin's scheme: short dependency
 * chains keep more iterations in flight. */
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
/* exp(x) for x in [LM_EXP_LO, 0] (x clamped by the caller). NaN in x gives
 * an unspecified value: the caller tracks NaN on its own. 1 + r is formed
 * beside the polynomial, off its dependency chain. */
LM_INLINE VF LM_FN(exp_)(VF x) {
    VF t, r, r2, d = LM_FN(reduce_)(x, &t, &r, &r2);
    return v_scale(v_fma(d, r2, v_add(r, v_set1(1.0f))), t);
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
#endif

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

/* Accumulators of one block, in double. */
typedef struct { double s, t, rs, c; LANE_T nmax, nrmax; int nan; } LM_FN(acc_);

/* One block: exp sums of (z, r)[0, len) against the maxima (M, RM), fused
 * with the max of the next block (zn, rn)[0, nlen), nlen <= len; when there
 * is no next block, prefetch pf[0, pflen) bytes (the next segment) instead. */
LM_INLINE void LM_FN(block_)(const LM_ELEM *z, const LM_ELEM *r, int64_t len,
                              const LM_ELEM *zn, const LM_ELEM *rn, int64_t nlen,
                              const char *pf, int64_t pflen, LANE_T M, LANE_T RM,
                              const int ent, const int ref, const int capped,
                              VF vc, VF vic, LM_FN(acc_) *out) {
    const VF lo = v_set1(LM_EXP_LO), vm = v_set1(M), vrm = v_set1(RM);
    const VF zero = v_set1(0.0f);
    VF s0 = zero, s1 = zero, t0 = zero, t1 = zero;
    VF rs0 = zero, rs1 = zero, c0 = zero, c1 = zero;
    VF mx = v_set1(-INFINITY), rmx = mx;
    VF nz = zero, nr = zero; /* sums of the clamped differences: NaN-sticky */
    int64_t j = 0;

/* acc += a + b (acc += a x + b y): the a and b lanes go to two
 * accumulators, or, for a row pair (ref), to one, which keeps the KL pass's
 * accumulators in AVX2's 16 registers (ref blocks are half as long, so a
 * lane still sums at most 64 terms). */
#define LM_ADD2(acc0, acc1, a, b)                                              \
    do {                                                                       \
        if (ref) acc0 = v_add(acc0, v_add(a, b));                              \
        else { acc0 = v_add(acc0, a); acc1 = v_add(acc1, b); }                 \
    } while (0)
#define LM_FMA2(acc0, acc1, a, x, b, y)                                        \
    do {                                                                       \
        if (ref) acc0 = v_fma(a, x, v_fma(b, y, acc0));                        \
        else { acc0 = v_fma(a, x, acc0); acc1 = v_fma(b, y, acc1); }           \
    } while (0)
#define LM_EXP_STEP()                                                          \
    do {                                                                       \
        VF za, zb, ua, ub, da, db, ea, eb;                                     \
        LM_LOADC(z + j, za, zb);                                               \
        ua = v_sub(za, vm);                                                    \
        ub = v_sub(zb, vm);                                                    \
        da = v_max(lo, ua);                                                    \
        db = v_max(lo, ub);                                                    \
        if (!ent) nz = v_add(nz, v_add(da, db));                               \
        ea = LM_FN(exp_)(da);                                                  \
        eb = LM_FN(exp_)(db);                                                  \
        LM_ADD2(s0, s1, ea, eb);                                               \
        if (ent) LM_FMA2(t0, t1, ea, da, eb, db);                              \
        if (ref) {                                                             \
            VF ra, rb, dra, drb, era, erb;                                     \
            LM_LOADC(r + j, ra, rb);                                           \
            dra = v_max(lo, v_sub(ra, vrm));                                   \
            drb = v_max(lo, v_sub(rb, vrm));                                   \
            nr = v_add(nr, v_add(dra, drb));                                   \
            era = LM_FN(exp_)(dra);                                            \
            erb = LM_FN(exp_)(drb);                                            \
            LM_ADD2(rs0, rs1, era, erb);                                       \
            LM_FMA2(c0, c1, era, v_zero_neginf(v_sub(dra, ua), ra),            \
                    erb, v_zero_neginf(v_sub(drb, ub), rb));                   \
        }                                                                      \
    } while (0)

    for (; j < nlen; j += LM_STEP) {
        VF a, b;
        LM_LOADC(zn + j, a, b);
        __builtin_prefetch((const char *)(zn + j) + LM_PREFETCH_BYTES, 0, 3);
        mx = v_max(v_max(a, b), mx);
        if (ref) {
            LM_LOADC(rn + j, a, b);
            __builtin_prefetch((const char *)(rn + j) + LM_PREFETCH_BYTES, 0, 3);
            rmx = v_max(v_max(a, b), rmx);
        }
        LM_EXP_STEP();
    }
    for (; j < len; j += LM_STEP) {
        int64_t off = j * (int64_t)sizeof(LM_ELEM);
        if (off < pflen) __builtin_prefetch(pf + off, 0, 3);
        LM_EXP_STEP();
    }
#undef LM_EXP_STEP
#undef LM_ADD2
#undef LM_FMA2
    out->s = LM_FN(hsum_)(v_add(s0, s1));
    out->t = ent ? LM_FN(hsum_)(v_add(t0, t1)) : 0.0;
    out->rs = ref ? LM_FN(hsum_)(v_add(rs0, rs1)) : 0.0;
    out->c = ref ? LM_FN(hsum_)(v_add(c0, c1)) : 0.0;
    out->nmax = LM_FN(hmax_)(mx);
    out->nrmax = ref ? LM_FN(hmax_)(rmx) : (LANE_T)-INFINITY;
    /* d = max(lo, z - m) is finite unless z is NaN, and so are their sums */
    out->nan = (isnan(ent ? out->t : LM_FN(hsum_)(nz)) ? 1 : 0) | (ref && isnan(LM_FN(hsum_)(nr)) ? 2 : 0);
}

/* Raise the running max of one side to bm: s scales by a = exp(m - bm),
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
    const int64_t blk = ref ? LM_BLK / 2 : LM_BLK; /* see LM_ADD2 */
    const int64_t nv = n - n % LM_STEP, nmain = (nv + blk - 1) / blk;
    const int64_t nblocks = nmain + (nv < n);
    LM_ELEM tz[LM_STEP], tr[LM_STEP];
    double M = -INFINITY, S = 0.0, T = 0.0, RM = -INFINITY, RS = 0.0, C = 0.0;
    int64_t am = -1, ram = -1, kz = -1, kr = -1; /* blocks of the final maxima */
    LANE_T bm, brm = (LANE_T)-INFINITY;

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

    if (nblocks > 0) {
        const LM_ELEM *zp, *rp;
        int64_t len;
        LM_BLOCK_AT(0, zp, rp, len);
        bm = LM_FN(max_)(zp, len, capped, vc, vic);
        if (ref) brm = LM_FN(max_)(rp, len, capped, vc, vic);
    }
    for (int64_t k = 0; k < nblocks; k++) {
        const LM_ELEM *zp, *rp, *zn = NULL, *rn = NULL;
        int64_t len, nlen = 0;
        LM_FN(acc_) acc;
        LM_BLOCK_AT(k, zp, rp, len);
        if (k + 1 < nblocks) LM_BLOCK_AT(k + 1, zn, rn, nlen);
        if (bm == INFINITY || brm == INFINITY) { st->posinf = 1; return; }
        if (bm > M) {
            kz = k;
            LM_FN(raise_)(&M, &S, ent ? &T : NULL, RS, ref ? &C : NULL, bm);
        }
        if (ref && brm > RM) {
            kr = k;
            LM_FN(raise_)(&RM, &RS, &C, 0.0, NULL, brm);
        }
        /* With M == -inf so far (all -inf), exponentiate against 0 and drop
         * the sums: the pass still looks for NaN. */
        LM_FN(block_)(zp, rp, len, zn, rn, nlen, (const char *)next,
                      next && k + 1 == nblocks ? len * (int64_t)sizeof(LM_ELEM) : 0,
                      (LANE_T)(M == -INFINITY ? 0.0 : M),
                      (LANE_T)(RM == -INFINITY ? 0.0 : RM), ent, ref, capped, vc, vic, &acc);
        st->nan_found |= acc.nan;
        if (M != -INFINITY) { S += acc.s; T += acc.t; }
        if (ref && RM != -INFINITY) { RS += acc.rs; C += acc.c; }
        bm = acc.nmax;
        brm = acc.nrmax;
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
#undef LM_BLOCK_AT
#undef LM_BLK_LEN
    st->m = M; st->s = S; st->t = T; st->amax = am;
    st->rm = RM; st->rs = RS; st->c = C; st->ramax = ram;
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
#undef LM_STEP
#undef LM_BLK
