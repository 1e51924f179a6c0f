/* Standalone check of one ISA unit's segment kernels against a float64
 * reference and against the portable (scalar) unit: random rows of many
 * lengths (tails included), every dtype the unit has and every flag set the
 * driver uses. Built for aarch64 and run under qemu by
 * tests/core/test_neon_qemu.py (the NEON unit, the default); any other unit by
 * -DLM_TEST_UNIT=lm_unit_avx2 -DLM_HAVE_AVX2 (and its ISA flags).
 * Prints "ok <checks> checks, dtypes <the unit's>" and exits 0, or prints
 * each failure and exits 1. */
#include <stdio.h>
#include <stdlib.h>
#include "lm_internal.h"

#ifndef LM_TEST_UNIT
#define LM_TEST_UNIT lm_unit_neon
#define LM_HAVE_NEON 1
extern const lm_unit lm_unit_neon;
#endif

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng_u64(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static double rng_unit(void) { return ((rng_u64() >> 11) + 0.5) * (1.0 / 9007199254740992.0); }
static double rng_normal(void) {
    return sqrt(-2.0 * log(rng_unit())) * cos(6.283185307179586 * rng_unit());
}

/* a random element of the dtype, stored at buf[i]; returns its value */
static double put(void *buf, int dtype, int64_t i, double x) {
    if (dtype == LM_F64) {
        ((double *)buf)[i] = x;
        return x;
    }
    if (dtype == LM_F32) {
        ((float *)buf)[i] = (float)x;
        return ((float *)buf)[i];
    }
    if (dtype == LM_BF16) {
        float f = (float)x;
        uint32_t u;
        memcpy(&u, &f, 4);
        ((uint16_t *)buf)[i] = (uint16_t)(u >> 16);
        return lm_bf16_to_float((uint16_t)(u >> 16));
    }
    { /* f16: rounded by the float -> f16 steps for normal numbers, else 0 */
        float f = (float)x;
        uint32_t u, a;
        uint16_t h;
        memcpy(&u, &f, 4);
        a = u & 0x7fffffffu;
        if (a >= 0x7f800000u) h = (uint16_t)((u >> 16) & 0x8000u) | (a > 0x7f800000u ? 0x7e00u : 0x7c00u);
        else if (a < 0x38800000u) h = (uint16_t)((u >> 16) & 0x8000u); /* below the f16 normals */
        else if (a >= 0x477ff000u) h = (uint16_t)((u >> 16) & 0x8000u) | 0x7c00u;
        else h = (uint16_t)(((u >> 16) & 0x8000u) | ((a - 0x38000000u + 0x1000u) >> 13));
        ((uint16_t *)buf)[i] = h;
        return lm_f16_to_float(h);
    }
}

/* logsumexp, entropy, KL, the max and log S = logsumexp - max (apart:
 * with huge logits the difference of the two loses log S) */
typedef struct { double lse, ent, kl, max, ls; int64_t amax, ramax; } ref_t;

static double capv(double x, double cap) { return cap > 0 ? cap * tanh(x / cap) : x; }

/* s += x with Neumaier's compensation in *comp (the sum is s + *comp): a
 * row of many equal terms summed plainly is off by up to n eps / 2, past
 * float64's contract */
static void add_comp(double *s, double *comp, double x) {
    double t = *s + x;
    *comp += fabs(*s) >= fabs(x) ? (*s - t) + x : (x - t) + *s;
    *s = t;
}

static ref_t reference(const double *z, const double *r, int64_t n, double cap) {
    ref_t o = {0, 0, 0, -INFINITY, 0, -1, -1};
    double m = -INFINITY, rm = -INFINITY, s = 0, t = 0, rs = 0, c = 0, sc = 0, tc = 0, rsc = 0, cc = 0;
    for (int64_t i = 0; i < n; i++) {
        double y = capv(z[i], cap);
        if (y > m) { m = y; o.amax = i; }
        if (r) {
            double ry = capv(r[i], cap);
            if (ry > rm) { rm = ry; o.ramax = i; }
        }
    }
    for (int64_t i = 0; i < n; i++) {
        double y = capv(z[i], cap), e = exp(y - m);
        add_comp(&s, &sc, e);
        if (e > 0) add_comp(&t, &tc, e * (y - m));
    }
    s += sc;
    t += tc;
    o.max = m;
    o.ls = log(s);
    o.lse = m + o.ls;
    o.ent = log(s) - t / s;
    if (r) {
        for (int64_t i = 0; i < n; i++) {
            double ry = capv(r[i], cap), y = capv(z[i], cap), e = exp(ry - rm);
            add_comp(&rs, &rsc, e);
            if (e > 0) add_comp(&c, &cc, e * ((ry - rm) - (y - m)));
        }
        rs += rsc;
        c += cc;
        /* sum p_r (log p_r - log p_z), log p_r = ry - rm - log rs,
         * log p_z = y - m - log s */
        o.kl = c / rs - log(rs) + o.ls;
    }
    return o;
}

static int failures = 0, checks = 0;

/* equal (infinities included), or within tol relative to 1 + |want| */
static int close_to(double got, double want, double tol) {
    return got == want || fabs(got - want) <= tol * (1 + fabs(want));
}

static void expect(int ok, const char *what, const char *unit, int dtype, int64_t n, int flags, double got,
                   double want) {
    checks++;
    if (!ok) {
        failures++;
        if (failures <= 20)
            printf("FAIL %s %s dtype=%d n=%lld flags=%d: got %.9g want %.9g\n", unit, what, dtype,
                   (long long)n, flags, got, want);
    }
}

static void check_state(const char *unit, const lm_state *st, const ref_t *ref, int dtype, int64_t n,
                        int flags, double cap) {
    /* float lanes (a softcap in float); double lanes: float64's contract */
    double tol = dtype == LM_F64 ? 1e-13 : cap > 0 ? 2e-5 : 4e-6;
    double lse, ent;
    if (st->exact) return; /* the driver's exact path */
    expect(!st->nan, "nan flag", unit, dtype, n, flags, st->nan, 0);
    lse = st->shift + log(st->sum);
    expect(close_to(lse, ref->lse, tol), "logsumexp", unit, dtype, n, flags, lse,
           ref->lse);
    if (flags & LM_WANT_ENT) {
        ent = log(st->sum) - st->dsum / st->sum;
        expect(close_to(ent, ref->ent, tol), "entropy", unit, dtype, n, flags, ent,
               ref->ent);
    }
    { /* top_logprob, as the driver takes it: (max - shift) - log sum */
        double top = (st->max - st->shift) - log(st->sum);
        expect(close_to(top, -ref->ls, tol), "top logprob", unit, dtype, n, flags, top, -ref->ls);
        expect(top <= 1e-15, "top logprob <= 0", unit, dtype, n, flags, top, 0);
    }
    if ((flags & LM_WANT_AMAX) && !(flags & LM_WANT_CAP))
        expect(st->argmax == ref->amax, "argmax", unit, dtype, n, flags, (double)st->argmax, (double)ref->amax);
    if (flags & LM_WANT_REF) {
        /* KL = cross / ref_sum - log ref_sum + log sum (lm_internal.h) */
        double kl = st->cross / st->ref_sum - log(st->ref_sum) + log(st->sum);
        expect(close_to(kl, ref->kl, 4 * tol), "kl", unit, dtype, n, flags, kl, ref->kl);
        if ((flags & LM_WANT_AMAX) && !(flags & LM_WANT_CAP))
            expect(st->ref_argmax == ref->ramax, "ref argmax", unit, dtype, n, flags, (double)st->ref_argmax,
                   (double)ref->ramax);
    }
}

/* The rank's count (LM_WANT_RANK, with the flag set's cap): the values
 * above the target's and those equal to it before it (the argmax's order:
 * rank 0 exactly at the first argmax), for targets at both ends, the
 * middle, the first and the last argmax, the first -inf, and the elements
 * around the first steps' edges; each also as a segment of a longer row
 * whose target lies before it (at < 0: the values above count) or after it
 * (at >= n: the values >= the target's count). The threshold is the one
 * the driver takes (the unit's lane value of the target, lm_value_fn).
 * vals (n doubles) is scratch. Without a cap the lane values are the
 * stored ones (the dtype's own order); float64's, with a cap, libm's tanh. */
static void check_rank(const lm_unit *unit, const void *zb, int dtype, int64_t n, int flags, double cap,
                       double *vals) {
    int64_t targets[48], nt = 0, first = 0, last = 0, neginf = -1;
    for (int64_t k = 0; k < n; k++) {
        double stored = lm_load1(zb, dtype, k);
        vals[k] = unit->values[dtype](zb, k, cap);
        if (vals[k] > vals[first]) first = k;
        if (vals[k] >= vals[last]) last = k;
        if (neginf < 0 && vals[k] == -INFINITY) neginf = k;
        if (cap <= 0)
            expect(vals[k] == stored || (isnan(vals[k]) && isnan(stored)), "lane value", "unit", dtype, n, flags,
                   vals[k], stored);
        else if (dtype == LM_F64)
            expect(vals[k] == lm_softcap(stored, cap) || isnan(stored) || stored == -INFINITY, "lane value (cap)",
                   "unit", dtype, n, flags, vals[k], lm_softcap(stored, cap));
    }
    targets[nt++] = n / 2;
    targets[nt++] = first;
    targets[nt++] = last;
    targets[nt++] = n - 1;
    if (neginf >= 0) targets[nt++] = neginf;
    for (int64_t k = 0; k < 70 && nt < 48; k += (k % 8 == 0 || k % 8 == 7) ? 1 : 6)
        if (k < n) targets[nt++] = k; /* 0, 1, 7, 8, 9, 15, 16, 17, ...: each side of a step's edge */
    for (int64_t ti = 0; ti < nt; ti++) {
        const double thr = vals[targets[ti]];
        const int64_t ats[3] = {targets[ti], -1 - targets[ti], n + targets[ti]};
        for (int a = 0; a < 3; a++) {
            lm_state sr;
            int64_t want = 0;
            for (int64_t k = 0; k < n; k++) want += vals[k] > thr || (k < ats[a] && vals[k] == thr);
            unit->kernels[dtype](zb, NULL, n, flags | LM_WANT_RANK, cap, thr, ats[a], NULL, NULL, &sr);
            if (sr.exact) continue;
            expect(sr.rank == want, "rank", "unit", dtype, n, flags | LM_WANT_RANK, (double)sr.rank, (double)want);
            if (a == 0 && targets[ti] == first)
                expect(sr.rank == 0, "rank of the first argmax", "unit", dtype, n, flags, (double)sr.rank, 0);
        }
    }
}

/* float64 rows at the edges of the double lanes' exp, each with every flag
 * set, the unit against the reference and the portable unit (which must
 * take the exact path for the same rows): huge and tiny logits, maxima
 * past LM_F64_MAX (+-2^50), terms below the clamp (shift - 700), -inf,
 * +inf, rows of equal terms, a row against itself; lengths around the
 * lane count and the block (256 elements in 2 lanes). */
static void check_edges_f64(const lm_unit *unit, void *zb, void *rb, double *z, double *r, double *vals) {
    static const int64_t lens[] = {1, 2, 3, 5, 257, 1001, 4099};
    static const int flag_sets[] = {0, LM_WANT_CAP, LM_WANT_ENT | LM_WANT_AMAX, LM_WANT_ENT | LM_WANT_AMAX | LM_WANT_CAP,
                                    LM_WANT_REF, LM_WANT_REF | LM_WANT_CAP, LM_WANT_ENT | LM_WANT_AMAX | LM_WANT_REF,
                                    LM_WANT_ENT | LM_WANT_AMAX | LM_WANT_REF | LM_WANT_CAP};
    enum { NKINDS = 14 };
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        const int64_t n = lens[li];
        for (int kind = 0; kind < NKINDS; kind++) {
            /* exact: the row must take the exact path (no flags: -1) */
            int exact = 0, same = 0;
            for (int64_t i = 0; i < n; i++) {
                double g = rng_normal(), x, y = rng_normal() * 2;
                switch (kind) {
                case 0: x = g * 5 + 1e12; y = y + 1e12; break;       /* huge, within 2^50 */
                case 1: x = g * 1e3 - 1e14; y = y * 1e3 - 1e14; break; /* huge negative, spread */
                case 2: x = g * 1e-300; break;                       /* tiny */
                case 3: x = (i % 3 == 0) ? 4.9e-324 : (i % 3 == 1) ? -0.0 : 0.0; break; /* subnormal, zeros */
                case 4: x = 0.0; y = 0.0; break;                      /* all zero: log n exactly */
                case 5: x = -1e4 * rng_unit(); y = -1e3 * rng_unit(); break; /* most terms below the clamp */
                case 6: x = i == n - 1 ? 3.5 : -INFINITY; break;     /* -inf but the tail's last */
                case 7: x = -INFINITY; break;                         /* all -inf */
                case 8: x = i == n / 2 ? 0.0 : -3.0; y = i == 0 ? 0.0 : -0.5; break; /* two levels */
                case 9: x = i == n / 2 ? 0.0 : 0.75; y = x; same = 1; break; /* two levels, a row against itself */
                case 10: x = g * 3; y = x; same = 1; break;            /* a row against itself */
                case 11: x = i == n / 3 ? 2e15 : g; exact = 1; break;  /* a max past 2^50 */
                case 12: x = g - 1e300; exact = 1; break;              /* all past -2^50 */
                default: x = i == n - 1 ? INFINITY : g; exact = 1; break; /* +inf */
                }
                z[i] = put(zb, LM_F64, i, x);
                r[i] = put(rb, LM_F64, i, y);
            }
            for (size_t fi = 0; fi < sizeof flag_sets / sizeof flag_sets[0]; fi++) {
                const int flags = flag_sets[fi];
                const int ref = (flags & LM_WANT_REF) != 0;
                const double cap = (flags & LM_WANT_CAP) ? 30.0 : 0.0;
                lm_state st, sc;
                unit->kernels[LM_F64](zb, ref ? rb : NULL, n, flags, cap, INFINITY, 0, zb, ref ? rb : NULL, &st);
                lm_unit_scalar.kernels[LM_F64](zb, ref ? rb : NULL, n, flags, cap, INFINITY, 0, NULL, NULL, &sc);
                expect(st.exact == sc.exact, "exact path as the scalar unit", "edge", LM_F64, n, flags * 100 + kind,
                       st.exact, sc.exact);
                expect(!st.nan, "nan flag", "edge", LM_F64, n, flags * 100 + kind, st.nan, 0);
                if (exact && !cap) expect(st.exact, "exact path", "edge", LM_F64, n, flags * 100 + kind, st.exact, 1);
                if (st.exact) continue;
                if (kind == 7 && !cap) { /* nothing above -inf: no shift, no sums, no argmax (capped,
                                          * -inf is -c, a value like any other) */
                    expect(st.shift == -INFINITY && st.max == -INFINITY && st.sum == 0 && st.dsum == 0,
                           "all -inf state", "edge", LM_F64, n, flags, st.sum, 0);
                    if (flags & LM_WANT_AMAX)
                        expect(st.argmax == -1, "all -inf argmax", "edge", LM_F64, n, flags, (double)st.argmax, -1);
                    continue;
                }
                {
                    ref_t want = reference(z, ref ? r : NULL, n, cap);
                    /* log S (the NLL's part beside max - z_y) and the top
                     * token's log p are held to 1e-13 of themselves, not of
                     * the huge logsumexp */
                    double ls = (st.shift - st.max) + log(st.sum), wls = want.ls;
                    check_state("edge", &st, &want, LM_F64, n, flags, cap);
                    check_state("edge scalar", &sc, &want, LM_F64, n, flags, cap);
                    expect(close_to(ls, wls, 1e-13), "log sum", "edge", LM_F64, n, flags * 100 + kind, ls, wls);
                    if (kind == 4 && !cap) { /* e^0 exact: log n and entropy log n, exactly but
                                             * for the padding's clamped terms (e^-700 a lane) */
                        expect(ls == log((double)n), "zeros: log n", "edge", LM_F64, n, flags, ls, log((double)n));
                        if (flags & LM_WANT_ENT)
                            expect(close_to(log(st.sum) - st.dsum / st.sum, log((double)n), 1e-290),
                                   "zeros: entropy log n", "edge", LM_F64, n, flags, log(st.sum) - st.dsum / st.sum,
                                   log((double)n));
                    }
                    if (kind == 6 && !cap) /* one finite value: its own term, exactly */
                        expect(st.sum == 1.0 && st.max == 3.5 && ls == 0.0, "one finite value", "edge", LM_F64, n,
                               flags, st.sum, 1.0);
                    if (same && ref) { /* KL of a row against itself: 0 exactly */
                        double kl = st.cross / st.ref_sum - log(st.ref_sum) + log(st.sum);
                        expect(kl == 0.0, "KL against itself", "edge", LM_F64, n, flags, kl, 0.0);
                    }
                    if (!(flags & LM_WANT_REF) && kind != 6) check_rank(unit, zb, LM_F64, n, flags, cap, vals);
                }
            }
        }
        /* NaN anywhere, in either buffer, with every flag set: reported */
        for (int64_t pos = 0; pos < n; pos += n / 4 + 1) {
            for (size_t fi = 0; fi < sizeof flag_sets / sizeof flag_sets[0]; fi++) {
                const int flags = flag_sets[fi];
                const int ref = (flags & LM_WANT_REF) != 0;
                const double cap = (flags & LM_WANT_CAP) ? 30.0 : 0.0;
                lm_state st;
                for (int side = 0; side < 1 + ref; side++) {
                    for (int64_t i = 0; i < n; i++) {
                        put(zb, LM_F64, i, side == 0 && i == pos ? NAN : rng_normal());
                        put(rb, LM_F64, i, side == 1 && i == pos ? NAN : rng_normal());
                    }
                    unit->kernels[LM_F64](zb, ref ? rb : NULL, n, flags, cap, INFINITY, 0, NULL, NULL, &st);
                    expect(st.exact || (st.nan & (side ? 2 : 1)), "NaN reported", "edge", LM_F64, n,
                           flags * 100 + side, st.nan, side ? 2 : 1);
                }
            }
        }
    }
}

int main(void) {
    static const int64_t lens[] = {1, 2, 3, 5, 6, 7, 8, 9, 15, 16, 17, 31, 33, 100, 255, 256, 257, 511, 513, 1000,
                                    4095, 4096, 4097, 9000, 32768};
    static const int flag_sets[] = {0, LM_WANT_CAP, LM_WANT_ENT | LM_WANT_AMAX,
                                    LM_WANT_ENT | LM_WANT_AMAX | LM_WANT_CAP,
                                    LM_WANT_REF, LM_WANT_REF | LM_WANT_CAP,
                                    LM_WANT_ENT | LM_WANT_AMAX | LM_WANT_REF,
                                    LM_WANT_ENT | LM_WANT_AMAX | LM_WANT_REF | LM_WANT_CAP};
    static const int dtypes[] = {LM_F32, LM_F16, LM_BF16, LM_F64};
    const lm_unit *unit = &LM_TEST_UNIT;
    const int64_t nmax = 32768;
    void *zb = malloc(nmax * 8), *rb = malloc(nmax * 8);
    double *z = malloc(nmax * sizeof(double)), *r = malloc(nmax * sizeof(double));
    double *vals = malloc(nmax * sizeof(double));
    for (int di = 0; di < 4; di++) {
        int dtype = dtypes[di];
        if (!unit->kernels[dtype]) continue;
        for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
            for (int kind = 0; kind < 5; kind++) {
                int64_t n = lens[li];
                /* 0: N(0, 3); 1: offset by +40 with a few -inf; 2: one large
                 * value (a near one-hot row); 3: N(0, 8) offset -20; 4:
                 * ties: N(0, 3) rounded to a half, a few -inf */
                for (int64_t i = 0; i < n; i++) {
                    double x = kind == 3 ? rng_normal() * 8 - 20 : rng_normal() * 3 + (kind == 1 ? 40 : 0);
                    double y = kind == 3 ? rng_normal() * 8 - 20 : rng_normal() * 3 + (kind == 1 ? 40 : 0);
                    if ((kind == 1 || kind == 4) && n > 1 && rng_u64() % 8 == 0) x = -INFINITY;
                    if (kind == 2 && i == (int64_t)(rng_u64() % (uint64_t)n)) x = 25;
                    if (kind == 4 && isfinite(x)) x = floor(x * 2) / 2;
                    z[i] = put(zb, dtype, i, x);
                    r[i] = put(rb, dtype, i, y);
                }
                for (size_t fi = 0; fi < sizeof flag_sets / sizeof flag_sets[0]; fi++) {
                    int flags = flag_sets[fi];
                    double cap = (flags & LM_WANT_CAP) ? 30.0 : 0.0;
                    ref_t ref = reference(z, (flags & LM_WANT_REF) ? r : NULL, n, cap);
                    lm_state st, sc;
                    /* where the data goes on (prefetched, never read): any address */
                    unit->kernels[dtype](zb, (flags & LM_WANT_REF) ? rb : NULL, n, flags, cap, INFINITY, 0, zb,
                                         (flags & LM_WANT_REF) ? rb : NULL, &st);
                    lm_unit_scalar.kernels[dtype](zb, (flags & LM_WANT_REF) ? rb : NULL, n, flags, cap,
                                                  INFINITY, 0, NULL, NULL, &sc);
                    if (!(flags & LM_WANT_REF)) check_rank(unit, zb, dtype, n, flags, cap, vals);
                    check_state("unit", &st, &ref, dtype, n, flags, cap);
                    check_state("scalar", &sc, &ref, dtype, n, flags, cap);
                    if (!st.exact && !sc.exact) {
                        double a = st.shift + log(st.sum), b = sc.shift + log(sc.sum);
                        expect(close_to(a, b, dtype == LM_F64 ? 1e-13 : 4e-6), "unit vs scalar", "unit", dtype, n, flags, a,
                               b);
                        if (dtype == LM_F64 && (flags & LM_WANT_ENT)) { /* the same contract, both ways */
                            a = log(st.sum) - st.dsum / st.sum;
                            b = log(sc.sum) - sc.dsum / sc.sum;
                            expect(close_to(a, b, 1e-13), "entropy vs scalar", "unit", dtype, n, flags, a, b);
                        }
                        if (dtype == LM_F64 && (flags & LM_WANT_REF)) {
                            a = st.cross / st.ref_sum - log(st.ref_sum) + log(st.sum);
                            b = sc.cross / sc.ref_sum - log(sc.ref_sum) + log(sc.sum);
                            expect(close_to(a, b, 4e-13), "kl vs scalar", "unit", dtype, n, flags, a, b);
                        }
                        if (flags & LM_WANT_AMAX)
                            expect(st.argmax == sc.argmax, "argmax vs scalar", "unit", dtype, n, flags,
                                   (double)st.argmax, (double)sc.argmax);
                    }
                }
            }
        }
        /* NaN anywhere in a row is found */
        for (int64_t pos = 0; pos < 37; pos += 6) {
            int64_t n = 37;
            lm_state st;
            for (int64_t i = 0; i < n; i++) put(zb, dtype, i, i == pos ? NAN : rng_normal());
            unit->kernels[dtype](zb, NULL, n, LM_WANT_ENT | LM_WANT_AMAX, 0.0f, INFINITY, 0, NULL, NULL, &st);
            expect(st.nan || st.exact, "NaN found", "unit", dtype, n, pos, st.nan, 1);
        }
        /* float32 NaN of any sign and payload, capped or not (the lanes'
         * softcap scales by an integer add that low payload bits reach) */
        if (dtype == LM_F32) {
            static const uint32_t nans[4] = {0x7fc00000u, 0x7f800001u, 0xff800001u, 0xffffffffu};
            for (int q = 0; q < 8; q++) {
                int64_t n = 37, pos = 5 * q;
                int flags = LM_WANT_ENT | LM_WANT_AMAX | (q & 1 ? LM_WANT_CAP : 0);
                lm_state st;
                for (int64_t i = 0; i < n; i++) put(zb, dtype, i, rng_normal());
                memcpy((float *)zb + pos, &nans[q / 2], 4);
                unit->kernels[dtype](zb, NULL, n, flags, 3.0, INFINITY, 0, NULL, NULL, &st);
                expect(st.nan || st.exact, "NaN payload found", "unit", dtype, n, q, st.nan, 1);
            }
        }
    }
    if (unit->kernels[LM_F64]) check_edges_f64(unit, zb, rb, z, r, vals);
    {   /* the read pass: the max of n floats */
        float *f = (float *)zb, want = -INFINITY, got;
        for (int64_t i = 0; i < 4096; i++) {
            f[i] = (float)rng_normal();
            want = f[i] > want ? f[i] : want;
        }
        for (int prefetch = 0; prefetch < 2; prefetch++) {
            got = unit->read(f, 4096, prefetch);
            expect(got == want, "read pass max", "unit", LM_F32, 4096, prefetch, got, want);
        }
    }
    free(zb); free(rb); free(z); free(r); free(vals);
    if (failures) {
        printf("%d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("ok %d checks, dtypes", checks);
    for (int di = 0; di < 4; di++)
        if (unit->kernels[dtypes[di]]) printf(" %s", dtypes[di] == LM_F32 ? "f32" : dtypes[di] == LM_F64 ? "f64"
                                                   : dtypes[di] == LM_F16 ? "f16" : "bf16");
    printf("\n");
    return 0;
}
