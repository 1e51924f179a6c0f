/* Standalone check of one ISA unit's segment kernels against a float64
 * reference and against the portable (scalar) unit: random rows of many
 * lengths (tails included), every dtype the unit has and every flag set the
 * driver uses. Built for aarch64 and run under qemu by
 * tests/test_neon_qemu.py (the NEON unit, the default); any other unit by
 * -DLM_TEST_UNIT=lm_unit_avx2 -DLM_HAVE_AVX2 (and its ISA flags).
 * Prints "ok <checks>" and exits 0, or prints each failure and exits 1. */
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

typedef struct { double lse, ent, kl; int64_t amax, ramax; } ref_t;

static double capv(double x, double cap) { return cap > 0 ? cap * tanh(x / cap) : x; }

static ref_t reference(const double *z, const double *r, int64_t n, double cap) {
    ref_t o = {0, 0, 0, -1, -1};
    double m = -INFINITY, rm = -INFINITY, s = 0, t = 0, rs = 0, c = 0;
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
        s += e;
        if (e > 0) t += e * (y - m);
    }
    o.lse = m + log(s);
    o.ent = log(s) - t / s;
    if (r) {
        for (int64_t i = 0; i < n; i++) {
            double ry = capv(r[i], cap), y = capv(z[i], cap), e = exp(ry - rm);
            rs += e;
            if (e > 0) c += e * ((ry - rm) - (y - o.lse));
        }
        /* sum p_r (log p_r - log p_z), log p_r = ry - rm - log rs,
         * log p_z = y - lse */
        o.kl = c / rs - log(rs);
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

int main(void) {
    static const int64_t lens[] = {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 100, 1000, 4095, 4096, 4097, 9000, 32768};
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
    for (int di = 0; di < 4; di++) {
        int dtype = dtypes[di];
        if (!unit->kernels[dtype]) continue;
        for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
            for (int kind = 0; kind < 4; kind++) {
                int64_t n = lens[li];
                /* 0: N(0, 3); 1: offset by +40 with a few -inf; 2: one large
                 * value (a near one-hot row); 3: N(0, 8) offset -20 */
                for (int64_t i = 0; i < n; i++) {
                    double x = kind == 3 ? rng_normal() * 8 - 20 : rng_normal() * 3 + (kind == 1 ? 40 : 0);
                    double y = kind == 3 ? rng_normal() * 8 - 20 : rng_normal() * 3 + (kind == 1 ? 40 : 0);
                    if (kind == 1 && n > 1 && rng_u64() % 8 == 0) x = -INFINITY;
                    if (kind == 2 && i == (int64_t)(rng_u64() % (uint64_t)n)) x = 25;
                    z[i] = put(zb, dtype, i, x);
                    r[i] = put(rb, dtype, i, y);
                }
                for (size_t fi = 0; fi < sizeof flag_sets / sizeof flag_sets[0]; fi++) {
                    int flags = flag_sets[fi];
                    double cap = (flags & LM_WANT_CAP) ? 30.0 : 0.0;
                    ref_t ref = reference(z, (flags & LM_WANT_REF) ? r : NULL, n, cap);
                    lm_state st, sc;
                    /* where the data goes on (prefetched, never read): any address */
                    unit->kernels[dtype](zb, (flags & LM_WANT_REF) ? rb : NULL, n, flags, cap, INFINITY, zb,
                                         (flags & LM_WANT_REF) ? rb : NULL, &st);
                    lm_unit_scalar.kernels[dtype](zb, (flags & LM_WANT_REF) ? rb : NULL, n, flags, cap,
                                                  INFINITY, NULL, NULL, &sc);
                    if (!cap && !(flags & LM_WANT_REF)) { /* the rank's count against the stored order */
                        lm_state sr;
                        double thr = lm_load1(zb, dtype, n / 2);
                        int64_t want = 0;
                        for (int64_t k = 0; k < n; k++) want += lm_load1(zb, dtype, k) > thr;
                        unit->kernels[dtype](zb, NULL, n, flags | LM_WANT_RANK, cap, thr, NULL, NULL, &sr);
                        if (!sr.exact)
                            expect(sr.rank == want, "rank", "unit", dtype, n, flags, (double)sr.rank, (double)want);
                    }
                    check_state("unit", &st, &ref, dtype, n, flags, cap);
                    check_state("scalar", &sc, &ref, dtype, n, flags, cap);
                    if (!st.exact && !sc.exact) {
                        double a = st.shift + log(st.sum), b = sc.shift + log(sc.sum);
                        expect(close_to(a, b, dtype == LM_F64 ? 1e-13 : 4e-6), "unit vs scalar", "unit", dtype, n, flags, a,
                               b);
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
            unit->kernels[dtype](zb, NULL, n, LM_WANT_ENT | LM_WANT_AMAX, 0.0f, INFINITY, NULL, NULL, &st);
            expect(st.nan || st.exact, "NaN found", "unit", dtype, n, pos, st.nan, 1);
        }
    }
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
    free(zb); free(rb); free(z); free(r);
    if (failures) {
        printf("%d of %d checks failed\n", failures, checks);
        return 1;
    }
    printf("ok %d checks\n", checks);
    return 0;
}
